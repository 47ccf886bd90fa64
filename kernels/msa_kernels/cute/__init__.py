"""CuTeDSL kernels for Hopper (sm_90a): one kernel class a file, its launcher beside it.

msa_kernels.ops picks them per phase of a step (its docstring narrates the data flow); each launcher has
the contract of the msa_kernels.reference function of its step.

decode phase
  index_scores.py          IndexScoreKernel, index_block_scores: causal max-pooled index block scores,
                           every token on its own (SIMT), on bf16 index-key pages (16 key elements a
                           lane for a single token, 8 for more)
  index_scores_fp8.py      Fp8IndexScoreKernel, fp8_index_block_scores: the same on FP8 index-key pages
                           (mma.sync on the e4m3 keys widened to f16)
  sparse_attn.py           SparseAttentionKernel, sparse_attention: GQA attention over the selected
                           blocks, one token per CTA (mma.sync), split-K over their K/V tiles; bf16 or
                           FP8 (e4m3) K/V pages (an FP8 cache's prefill tokens too)
  combine.py               CombineKernel, combine_splits: merges those split-K partials
prefill phase
  index_scores_prefill.py  PrefillIndexScoreKernel, prefill_index_block_scores: the same scores on
                           64-token tiles of a request (TMA + warpgroup MMAs)
  sparse_attn_prefill.py   PrefillAttentionKernel, prefill_sparse_attention: tiles of consecutive tokens
                           read the union of their blocks once (TMA + warpgroup MMAs), every tile
both phases
  topk_blocks.py           TopkBlocksKernel, topk_blocks: top-k blocks from the scores (radix select,
                           a CTA per decode row, a warp per prefill row)
  index_key_write.py       IndexKeyWriteKernel, write_index_keys: the step's index keys into bf16
                           index-key pages, or quantised into FP8 ones, on the device (no host sync)
  selection_stats.py       SelectionStatsKernel, add_selection_stats: what the step's selections add to
                           the served metrics' totals
the host tier (msa_kernels.host_tier's contracts; vllm_msa/host_tier.py serves them)
  page_resolve.py          PageResolveKernel, resolve_step: a decode step's selected blocks resolved to
                           device pages in one CTA (lookup, CLOCK replacement, copy list, block table)
  page_copy.py             PageCopyKernel, copy_pages: the missed pages from pinned host memory (UVA)
shared
  runtime.py               compiled_kernel(kernel class, params): compiled once per process for TVM-FFI
                           calls with torch tensors on torch's current stream, exported object files on
                           disk across processes; SM count, output copies
  warp_mma.py              MMA fragments, online softmax rows, tile copies, swizzles
  warpgroup_attention.py   the prefill attention's warpgroup pieces: its MMAs, the K/V cache's TMA
                           descriptor, query-row copies, P V, zeroing V past a request
  fp8_rows.py              e4m3 rounding of rows spread over lanes, bit for bit the reference's
  pdl.py                   programmatic dependent launch: the decode chain's kernels launch while the
                           one before finishes, and wait for it before touching memory
  fake.py                  symbolic tensors and stream for compiling without a GPU; what a call checks

A kernel file's anatomy: a frozen params dataclass (the static configuration), the kernel class with
can_implement (classmethod: the dtype and shapes it serves; msa_kernels.ops asks it), fake_arguments
(staticmethod: the symbolic arguments runtime.compiled_kernel compiles it on), the @cute.jit __call__
(layouts, grid) and the @cute.kernel kernel, then its launcher: a function with the reference's contract and
its bind_ form (bind_block_scores, bind_topk, bind_attention, bind_combine), which works out once what the calls
of a step share (the compiled kernel, splits, tiles, work tensors) and returns the launch a layer call makes
(msa_kernels.ops keeps it in the step part's workspace for the step's other layers). This file imports nothing;
the kernel files import CuTeDSL.
"""
