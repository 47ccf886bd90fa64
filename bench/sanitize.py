"""Small MSA layer runs for compute-sanitizer: every CuTeDSL kernel, on M3 and demo shapes.

    python3 -m bench.sanitize                                   # GPU machine, CuTeDSL staged
    compute-sanitizer --tool memcheck python3 -m bench.sanitize
    compute-sanitizer --tool racecheck python3 -m bench.sanitize

Run it plainly first: the sanitized runs then load the kernels from the disk cache
(msa_kernels.cute.runtime.compiled_kernel) instead of compiling under the sanitizer. Each case runs
msa_kernels.ops.msa_attention on a random paged problem whose unowned cache slots hold NaN and checks
the selection and output against the reference. ops splits each batch into its decode part (index
scores: the decode kernel; top-k; sparse attention: split-K + combine) and its prefill part (the
prefill index-score kernel; top-k; the prefill attention kernel); the demo shape's prefill part attends on the
per-token kernel (the prefill attention kernel does not serve 2 query heads an index head). Each case's selection
then attends over an FP8 K/V cache of the same values (the per-token kernel reading e4m3 pages, decode and
prefill tokens alike), and its index keys are scored from an FP8 index-key cache (the decode part on
index_scores_fp8.py, the prefill part on the prefill kernel's e4m3 variant). A single decode token's index scores
run the decode kernel's 16-elements-a-lane variant (index_scores.lane_elems_for). Last, a step's index keys are
written into the bf16 and the FP8 index-key cache (index_key_write.py) at random slots, padding among them, and
every byte compared with the reference's write.
"""

import torch

from bench.problems import M3_SHAPE as M3
from msa_kernels import ops, reference
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
    "M3 decode, one token": (M3, [1], [70001]),
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
        attend = (case.q, fp8, case.plan, want_sel, shape, case.scale)
        _check(f"{name}, FP8 K/V", ops.sparse_attention(*attend, kv_scales=kv_scales), want["FP8"])
        fp8_keys = Fp8IndexKeyCache.quantize(case.index_key_cache)  # NaN stays in the slots no request owns
        got = ops.index_block_scores(case.index_q, fp8_keys, case.plan, shape)
        want = reference.index_block_scores(case.index_q.float(), fp8_keys, case.batch, shape)
        finite = torch.isfinite(want)
        error = ((got[finite] - want[finite]).abs().max() / want[finite].abs().max()).item()
        print(f"{name}, FP8 index keys: largest score error {error:.1e} of the largest score")
        assert torch.equal(torch.isfinite(got), finite) and error <= 1e-2
        _check_index_key_writes(name, case.index_key_cache, shape, case.index_q.shape[0])


def _check_index_key_writes(name: str, index_key_cache: torch.Tensor, shape: MSAShape, tokens: int) -> None:
    keys = torch.randn(tokens, shape.num_index_key_heads, shape.index_head_dim, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(index_key_cache.shape[0] * shape.block_size, device="cuda")[:tokens]
    slots[::3] = -1  # padding: skipped
    for kind in ("bf16", "FP8"):
        got, want = (
            (index_key_cache.clone(), index_key_cache.clone())
            if kind == "bf16"
            else (Fp8IndexKeyCache.quantize(index_key_cache), Fp8IndexKeyCache.quantize(index_key_cache))
        )
        ops.write_index_keys(got, slots, keys, shape)
        reference.write_index_keys(want, slots, keys)
        planes = (lambda c: [c]) if kind == "bf16" else (lambda c: [c.values, c.scales])
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(planes(got), planes(want)))
        print(f"{name}, {kind} index-key write: bytes equal: {same}")
        assert same


if __name__ == "__main__":
    main()
