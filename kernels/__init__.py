"""MSA compute, usable without vLLM.

kernels.shapes     MSAShape (one layer's heads, dims, top-k) and PagedBatch (varlen batch, block
                   table, its split into decode and prefill requests)
kernels.ops        the entry points: for each phase of a batch, a CuTeDSL kernel or the reference per step
kernels.reference  index scores, top-k block selection and sparse attention in plain PyTorch
kernels.cute       the CuTeDSL kernels for Hopper (imported only where one runs)
kernels.testing    random paged problems with NaN-poisoned caches, for tests
"""
