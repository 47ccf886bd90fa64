"""MSA compute, usable without vLLM.

msa_kernels.shapes     MSAShape (one layer's heads, dims, top-k) and PagedBatch (varlen batch, block
                   table, its split into decode and prefill requests)
msa_kernels.ops        the entry points: for each phase of a batch, a CuTeDSL kernel or the reference per step
msa_kernels.reference  index scores, top-k block selection and sparse attention in plain PyTorch
msa_kernels.fp8_index_keys  FP8 index keys: the e4m3 page layout with per-token scales, the quantisation
msa_kernels.cute       the CuTeDSL kernels for Hopper (imported only where one runs)
msa_kernels.testing    random paged problems with NaN-poisoned caches, for tests
"""
