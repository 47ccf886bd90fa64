"""FP8 index keys (msa_kernels.fp8_index_keys): the quantisation's error bound, the page layout's byte offsets,
the reference's FP8 scores against the spec token by token and against bf16 index keys, and what msa_kernels.ops
runs for FP8 caches on a Hopper GPU (the CuTeDSL kernels' own checks: tests/test_cute_kernels.py)."""

import logging

import pytest
import torch

from msa_kernels import ops, reference
from msa_kernels.fp8_index_keys import (
    E4M3_MAX,
    MIN_AMAX,
    Fp8IndexKeyCache,
    dequantize_rows,
    page_bytes,
    quantize_rows,
    round_trip,
)
from msa_kernels.ops import msa_attention
from msa_kernels.shapes import MSAShape
from msa_kernels.stand_ins import no_op, stand_in_kernels
from msa_kernels.testing import make_case, small_shape
from tests.naive_msa import naive_msa

E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: rounding error <= 2^-4 of the value, for normal values
E4M3_HALF_SUBNORMAL_STEP = 2.0**-10  # below 2^-6 the step is 2^-9 (times the row's scale)


def test_round_trip_error_is_within_half_an_e4m3_step_and_the_largest_element_is_exact():
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-6, 4, 64)[:, None]  # rows from 1e-6 (below the amax floor) to 1e4
    x = torch.randn(64, 128, generator=g) * magnitudes
    x[3, 5] = 1000 * x[3].abs().max()  # one outlier: the rest of its row goes subnormal
    x[7] = 0
    values, scales = quantize_rows(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales, x.abs().amax(-1).clamp(min=MIN_AMAX) / E4M3_MAX)
    assert torch.isfinite(values.float()).all() and values.float().abs().max() == E4M3_MAX
    back = dequantize_rows(values, scales)
    assert torch.equal(back, round_trip(x)) and back.dtype == torch.float32
    bound = torch.maximum(E4M3_HALF_ULP * x.abs(), E4M3_HALF_SUBNORMAL_STEP * scales[:, None])
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    big = x.abs().amax(-1) >= MIN_AMAX
    top = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(1, top)[big], x.gather(1, top)[big], rtol=1e-6, atol=0)
    assert (back[7] == 0).all()
    # Saturating: x / scale rounds a hair past 448 for some rows; nothing becomes NaN there.
    assert not torch.isnan(quantize_rows(torch.tensor([[3.0, -3.0, 1.0]]) * 1.0000001)[0].float()).any()


def test_pages_hold_the_values_then_the_scales_at_vllms_indexer_key_offsets():
    block_size, hki, dp, num_pages = 4, 2, 8, 3
    raw = torch.zeros(num_pages, page_bytes(block_size, hki, dp), dtype=torch.uint8)
    assert raw.shape[1] == block_size * hki * dp + block_size * hki * 4
    cache = Fp8IndexKeyCache.from_pages(raw, block_size, hki, dp)
    assert cache.values.data_ptr() == raw.data_ptr() and cache.dtype == torch.float8_e4m3fn
    keys = torch.randn(5, hki, dp)
    slots = torch.tensor([5, -1, 0, 11, 2])  # page 1 token 1, padding, page 0 token 0, page 2 token 3, ...
    reference.write_index_keys(cache, slots, keys)
    values, scales = quantize_rows(keys)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, token = divmod(slot, block_size)
        for h in range(hki):
            at = (token * hki + h) * dp
            assert torch.equal(raw[page, at : at + dp], values[row, h].view(torch.uint8))
            at = block_size * hki * dp + (token * hki + h) * 4
            assert raw[page, at : at + 4].view(torch.float32).item() == scales[row, h].item()
    assert (raw[1, : hki * dp] == 0).all()  # page 1 token 0: no slot wrote it
    torch.testing.assert_close(cache.dequantize(torch.tensor([2]))[0, 3], round_trip(keys[3]), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"FP8 index-key pages must be uint8 \[num_pages, 96\]"):
        Fp8IndexKeyCache.from_pages(raw[:, :-4], block_size, hki, dp)


def _shape(**overrides) -> MSAShape:
    """msa_kernels.testing.small_shape with 2 index-key heads of 2 index heads each and 32-wide index keys."""
    return small_shape(**({"num_index_heads": 4, "num_index_key_heads": 2, "index_head_dim": 32} | overrides))


@pytest.mark.parametrize("q_lens, seq_lens", [([1, 1, 1], [37, 80, 129]), ([1, 45, 17], [96, 45, 50])])
def test_reference_with_fp8_index_keys_matches_the_spec_on_dequantized_keys_and_rounded_queries(q_lens, seq_lens):
    shape = _shape()
    case = make_case(shape, q_lens, seq_lens, seed=len(q_lens) + sum(seq_lens))  # NaN-poisoned unused slots
    fp8_cache = Fp8IndexKeyCache.quantize(case.index_key_cache)
    got, selected = msa_attention(case.q, case.index_q, case.kv_cache, fp8_cache, case.plan, shape, case.scale)
    # The scores: those of the float32 path (test_reference.py) on the FP8-rounded queries and dequantised keys.
    dequantized = dequantize_rows(fp8_cache.values, fp8_cache.scales)
    want_scores = reference.index_block_scores(round_trip(case.index_q), dequantized, case.batch, shape)
    assert torch.equal(ops.index_block_scores(case.index_q, fp8_cache, case.plan, shape), want_scores)
    rounded_q = round_trip(case.index_q).double()
    for r in range(case.batch.num_requests):
        keys, values, index_keys, tokens = case.request_tokens(r)
        index_keys = round_trip(index_keys).double()  # what the FP8 cache holds for these tokens
        positions = list(range(seq_lens[r] - q_lens[r], seq_lens[r]))
        want, want_sel = naive_msa(
            case.q[tokens], rounded_q[tokens], keys, values, index_keys, positions, shape, case.scale
        )
        for t, per_head in enumerate(want_sel):
            for h, blocks in enumerate(per_head):
                assert selected[tokens][t, h].tolist() == blocks + [-1] * (shape.topk_blocks - len(blocks)), (r, t, h)
        torch.testing.assert_close(got[tokens].double(), want, rtol=1e-5, atol=1e-5)


def test_fp8_scores_stay_within_the_e4m3_bound_of_bf16_scores_and_mostly_select_the_same_blocks():
    """Random bf16 index keys and queries at MiniMax-M3's Dp 128: the pessimistic case, since random keys give
    blocks whose max-pooled scores nearly tie (real activations: results/README.md)."""
    shape = _shape(num_index_key_heads=1, index_head_dim=128, topk_blocks=8, block_size=128)
    requests = 16
    q_lens, seq_lens = [1] * requests + [300], [3000 + 97 * r for r in range(requests)] + [2500]
    case = make_case(shape, q_lens, seq_lens, dtype=torch.bfloat16, seed=1)
    fp8_cache = Fp8IndexKeyCache.quantize(case.index_key_cache)
    bf16_scores = reference.index_block_scores(case.index_q, case.index_key_cache, case.batch, shape)
    fp8_scores = reference.index_block_scores(case.index_q, fp8_cache, case.batch, shape)
    visible = torch.isfinite(bf16_scores)
    assert torch.equal(visible, torch.isfinite(fp8_scores))
    # |q8.k8 - q.k| <= (2 * 2^-4 + 2^-8) sum |q| |k| per key, so per block at most that of the block's largest
    # sum |q| |k| (the index scores of |q| against |k|); subnormal steps add far less than the slack.
    abs_cache = case.index_key_cache.abs()
    bound = (2 * E4M3_HALF_ULP + E4M3_HALF_ULP**2) * reference.index_block_scores(
        case.index_q.abs(), abs_cache, case.batch, shape
    )
    assert ((fp8_scores - bf16_scores).abs()[visible] <= bound[visible] + 1e-3).all()
    positions = case.batch.positions
    bf16_selected = reference.topk_blocks(bf16_scores, positions, shape)
    fp8_selected = reference.topk_blocks(fp8_scores, positions, shape)
    identical = (bf16_selected == fp8_selected).all(-1).float().mean().item()
    shared = (fp8_selected[..., :, None] == bf16_selected[..., None, :]) & (fp8_selected[..., :, None] >= 0)
    overlap = shared.any(-1).sum().item() / (bf16_selected >= 0).sum().item()
    print(f"\nrandom bf16 vs FP8 index keys: {identical:.3f} of block sets identical, {overlap:.4f} of blocks shared")
    assert identical >= 0.6 and overlap >= 0.95


@pytest.fixture
def on_hopper():
    """msa_kernels.ops as on a Hopper GPU with CuTeDSL (the kernels' modules import without a GPU; stand_in_kernels
    empties the per-process caches of its choices before and after, and launches nothing)."""
    with stand_in_kernels(no_op):
        yield


def test_fp8_index_keys_on_hopper_run_cutedsl_in_both_phases_and_the_reference_where_unserved_with_one_warning(
    on_hopper, caplog
):
    from msa_kernels.cute import index_key_write, index_scores_fp8, index_scores_prefill
    from msa_kernels.cute.index_scores import IndexScoreKernel
    from msa_kernels.cute.index_scores_fp8 import Fp8IndexScoreKernel
    from msa_kernels.cute.index_scores_prefill import PrefillIndexScoreKernel

    shape = _shape(head_dim=64, index_head_dim=128, block_size=128)
    probe = torch.empty(0, dtype=torch.bfloat16)
    fp8 = Fp8IndexKeyCache.dtype
    assert Fp8IndexScoreKernel.can_implement(torch.bfloat16, fp8, 128, 128)
    assert not Fp8IndexScoreKernel.can_implement(torch.bfloat16, fp8, 16, 128)  # 16 bytes: not 4 lanes x 8
    assert not IndexScoreKernel.can_implement(torch.bfloat16, fp8, 128, 128)  # the SIMT kernel: bf16 keys
    assert PrefillIndexScoreKernel.can_implement(torch.bfloat16, fp8, 128, 128)  # its e4m3 variant
    assert not PrefillIndexScoreKernel.can_implement(torch.bfloat16, fp8, 512, 128)  # Dp over 256
    with caplog.at_level(logging.WARNING, logger="vllm.msa.kernels"):
        chosen = ops.kernels(probe.device, probe.dtype, fp8, False, shape)
        assert chosen.decode.index_scores is index_scores_fp8.fp8_index_block_scores
        assert chosen.prefill.index_scores is index_scores_prefill.prefill_index_block_scores
        assert ops.uses_cute_index_scores(probe, shape, "decode", index_key_dtype=fp8)
        assert ops.uses_cute_index_scores(probe, shape, "prefill", index_key_dtype=fp8)
        assert chosen.index_key_writer is index_key_write.write_index_keys
        assert ops.graph_capturable(probe.device, probe.dtype, shape, index_key_dtype=fp8)
        assert ops.describe(probe.device, probe.dtype, shape, index_key_dtype=fp8) == (
            "index scores: CuTeDSL, top-k: CuTeDSL, sparse attention: CuTeDSL, index-key writes: CuTeDSL"
        )
        # Dp 512: the decode kernel scores it (32 lanes of 16 e4m3) in both phases, the prefill kernel does not
        # (Dp over 256), nor the write kernel (64 lanes of 8 bf16), so the reference writes (a host sync) and a
        # decode step gets no full graph.
        wide = _shape(head_dim=64, index_head_dim=512, block_size=128)
        for phase in ("decode", "prefill"):
            steps = ops.kernels(probe.device, probe.dtype, fp8, False, wide).steps(phase)
            assert steps.index_scores is index_scores_fp8.fp8_index_block_scores
        assert not caplog.records
        # Dp 16: neither kernel scores it: the reference, one warning however often asked
        narrow = _shape(head_dim=64, index_head_dim=16, block_size=128)
        for fp8_kv in (False, True, False):  # the chooser asked again: one warning
            chosen_narrow = ops.kernels(probe.device, probe.dtype, fp8, fp8_kv, narrow)
            assert (
                chosen_narrow.decode.index_scores is chosen_narrow.prefill.index_scores is reference.index_block_scores
            )
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "index scores run the PyTorch path" in warnings[0], warnings
    assert ops.uses_cute_index_scores(probe, wide, "decode", index_key_dtype=fp8)
    assert ops.kernels(probe.device, probe.dtype, fp8, False, wide).index_key_writer is reference.write_index_keys
    assert not ops.graph_capturable(probe.device, probe.dtype, wide, index_key_dtype=fp8)
    assert ops.describe(probe.device, probe.dtype, wide, index_key_dtype=fp8).endswith("index-key writes: PyTorch")
    # bf16 index keys: both phases' kernels and the write kernel, whose bf16 rows may span a CTA (Dp 512 too)
    for bf16_shape in (shape, wide):
        assert ops.kernels(probe.device, probe.dtype, probe.dtype, False, bf16_shape).index_key_writer is (
            index_key_write.write_index_keys
        )
    assert ops.describe(probe.device, probe.dtype, shape) == (
        "index scores: CuTeDSL, top-k: CuTeDSL, sparse attention: CuTeDSL, index-key writes: CuTeDSL"
    )
    assert ops.graph_capturable(probe.device, probe.dtype, shape)


def test_ops_writes_fp8_index_keys_off_hopper_through_the_reference():
    shape = _shape()
    case = make_case(shape, [3], [40], seed=5)
    keys = torch.randn(5, shape.num_index_key_heads, shape.index_head_dim)
    slots = torch.tensor([17, -1, 3, 39])  # 4 slots for 5 rows: the last row is not written
    cache, want = (Fp8IndexKeyCache.quantize(case.index_key_cache) for _ in range(2))
    ops.write_index_keys(cache, slots, keys, shape)
    reference.write_index_keys(want, slots, keys)
    assert torch.equal(cache.values.view(torch.uint8), want.values.view(torch.uint8))
    assert torch.equal(cache.scales.nan_to_num(-1), want.scales.nan_to_num(-1))


def test_agreement_benchmark_counts_sets_blocks_and_cosines():
    """bench/fp8_agreement.py's bookkeeping: with top-k covering every block nothing can differ."""
    from bench.fp8_agreement import Agreement, random_inputs

    every_block = _shape(num_index_key_heads=1, index_head_dim=128, topk_blocks=8, block_size=128)
    agreement = Agreement()
    agreement.add(random_inputs(every_block, 1000, tokens=4, seed=0))  # 8 blocks
    assert (agreement.sets, agreement.identical, agreement.blocks, agreement.shared_blocks) == (16, 16, 128, 128)
    assert torch.cat(agreement.cosines).min().item() > 1 - 1e-6
    kv_cosines = torch.cat(agreement.kv_cosines)  # e4m3 K/V: close to the bf16 output, not equal
    assert kv_cosines.min().item() > 0.99 and kv_cosines.max().item() < 1 - 1e-6
    sparse = Agreement()
    sparse.add(random_inputs(_shape(num_index_key_heads=1, index_head_dim=128, block_size=16), 1000, 32, seed=0))
    assert sparse.sets == 128 and sparse.blocks == 128 * 3 and sparse.identical < sparse.sets  # top-3 of 63
    assert sparse.identical * 3 <= sparse.shared_blocks < sparse.blocks
    assert torch.cat(sparse.cosines).min().item() < 1 - 1e-3  # a differing set changes its token's output
    assert sparse.row(1000, 1.0).startswith("| 1000 | 128 | ")
