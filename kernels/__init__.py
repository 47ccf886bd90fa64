"""MSA compute, usable without vLLM: shape/batch descriptions and the PyTorch reference.

kernels.shapes    MSAShape (one layer's heads, dims, top-k) and PagedBatch (varlen batch, block table)
kernels.reference proxy scores, top-k block selection and sparse attention in plain PyTorch
"""
