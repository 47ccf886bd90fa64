"""Small MSA layer runs for compute-sanitizer: every CuTeDSL kernel, on M3 and demo shapes.

    python3 kernels/bench/sanitize.py                                   # GPU machine, CuTeDSL staged
    compute-sanitizer --tool memcheck python3 kernels/bench/sanitize.py
    compute-sanitizer --tool racecheck python3 kernels/bench/sanitize.py

Run it plainly first: the sanitized runs then load the kernels from the disk cache
(msa_kernels.cute.runtime.compiled_kernel) instead of compiling under the sanitizer. Each case runs
msa_kernels.ops.msa_attention on a random paged problem whose unowned cache slots hold NaN and checks
the selection and output against the reference. ops splits each batch into its decode part (index
scores: the decode kernel; top-k; sparse attention: split-K + combine) and its prefill part (the
prefill index-score kernel; top-k; the prefill attention kernel and the per-token kernel for the tiles it
leaves); the demo shape's prefill part attends on the per-token kernel (the prefill attention kernel
does not serve 2 query heads an index head). Each case's selection then attends over an FP8 K/V cache of the
same values (the per-token kernel reading e4m3 pages, decode and prefill tokens alike), and its index keys
are scored from an FP8 index-key cache (the decode part on index_scores_fp8.py, the prefill part on the
prefill kernel's e4m3 variant). Where four warps can share a K/V tile (M3's head dim), the per-token kernel attends
once more with them, over the bf16 and the FP8 cache (shared-memory exchanges between the warps: racecheck), and
where the prefill attention kernel serves the shape, it attends for every token on two warpgroups a CTA, and
where the block-major kernel does (sparse_attn_by_block.py), it too, alone and for the tiles the prefill kernel
leaves (its merge gated on the prefill kernel's flags).
"""

import torch

from msa_kernels import ops, reference
from msa_kernels.bench.problems import M3_SHAPE as M3
from msa_kernels.cute import sparse_attn, sparse_attn_by_block, sparse_attn_prefill
from msa_kernels.cute.sparse_attn_by_block import BlockMajorAttentionKernel
from msa_kernels.cute.sparse_attn_prefill import PrefillAttentionKernel
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache
from msa_kernels.shapes import MSAShape
from msa_kernels.testing import make_case

DEMO = MSAShape(
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=32,
    num_index_heads=4,
    num_index_key_heads=1,
    index_head_dim=32,
    topk_blocks=4,
)
CASES = {  # name: (shape, q_lens, seq_lens)
    "M3 decode, ragged": (M3, [1, 1, 1, 1], [7, 300, 2100, 5000]),
    "M3 prefill chunk": (M3, [200], [1000]),
    "M3 mixed": (M3, [1, 1, 130], [9000, 300, 2100]),
    "demo mixed": (DEMO, [1, 70, 1], [129, 700, 2600]),
}


def _check(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    cos = torch.nn.functional.cosine_similarity(got.float().flatten(), want.flatten(), dim=0).item()
    print(f"{label}: cosine {cos:.5f}")
    assert cos >= 0.99


def main() -> None:
    for name, (shape, q_lens, seq_lens) in CASES.items():
        case = make_case(shape, q_lens, seq_lens, dtype=torch.bfloat16, device="cuda", seed=len(name))
        check = case.layer_against_reference()
        same, cos, want_sel = check.selection_equal, check.cosine, check.reference_selection
        print(f"{name}: {ops.describe(case.q.device, case.q.dtype, shape)}; selection equal: {same}, cosine {cos:.5f}")
        assert same and cos >= 0.99
        kv_scales = (0.5, 2.0)  # the same selection over an FP8 K/V cache (sparse_attn.py reads the e4m3 pages)
        fp8 = reference.fp8_kv_cache(case.kv_cache, kv_scales)
        caches = {"bf16": (case.kv_cache, case.kv_cache.float(), (1.0, 1.0)), "FP8": (fp8, fp8, kv_scales)}
        want = {
            kv_name: reference.sparse_attention(
                case.q.float(), kv_reference, case.batch, want_sel, shape, case.scale, kv_scales=scales
            )
            for kv_name, (_, kv_reference, scales) in caches.items()
        }
        attend = (case.q, fp8, case.batch, want_sel, shape, case.scale)
        _check(f"{name}, FP8 K/V", ops.sparse_attention(*attend, kv_scales=kv_scales), want["FP8"])
        if sparse_attn.warps_can_share_tile(4, shape.head_dim):
            for kv_name, (kv_cache, _, scales) in caches.items():
                attend = (case.q, kv_cache, case.batch, want_sel, shape, case.scale)
                got = sparse_attn.sparse_attention(*attend, kv_scales=scales, warps=4)
                _check(f"{name}, four warps a tile, {kv_name} K/V", got, want[kv_name])
        heads = (shape.num_q_heads, shape.num_index_heads)
        if PrefillAttentionKernel.can_implement(torch.bfloat16, *heads, shape.head_dim, shape.block_size):
            attend = (case.q, case.kv_cache, case.batch, want_sel, shape, case.scale)
            got = sparse_attn_prefill.prefill_sparse_attention(*attend, max_union=10**6, warpgroups=2)
            _check(f"{name}, prefill kernel on two warpgroups", got, want["bf16"])
        if BlockMajorAttentionKernel.can_implement(torch.bfloat16, *heads, shape.head_dim, shape.block_size):
            attend = (case.q, case.kv_cache, case.batch, want_sel, shape, case.scale)
            got = sparse_attn_by_block.prefill_sparse_attention_by_block(*attend)
            _check(f"{name}, block by block", got, want["bf16"])
            got = sparse_attn_prefill.prefill_sparse_attention(*attend, max_union=24, leftovers="by_block")
            _check(f"{name}, prefill kernel, the tiles it leaves block by block", got, want["bf16"])
        fp8_keys = Fp8IndexKeyCache.quantize(case.index_key_cache)  # NaN stays in the slots no request owns
        got = ops.index_block_scores(case.index_q, fp8_keys, case.batch, shape)
        want = reference.index_block_scores(case.index_q.float(), fp8_keys, case.batch, shape)
        finite = torch.isfinite(want)
        error = ((got[finite] - want[finite]).abs().max() / want[finite].abs().max()).item()
        print(f"{name}, FP8 index keys: largest score error {error:.1e} of the largest score")
        assert torch.equal(torch.isfinite(got), finite) and error <= 1e-2


if __name__ == "__main__":
    main()
