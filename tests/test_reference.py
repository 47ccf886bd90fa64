"""msa_kernels.reference against the spec written out token by token, and against dense attention; PagedBatch
(positions, tiles, the decode/prefill split), msa_kernels.ops on batches that mix decodes and prefills, and the
metrics' selection totals (msa_kernels.selection_stats) against their definition."""

import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msa_kernels import ops
from msa_kernels.ops import msa_attention
from msa_kernels.plan import StepPlan
from msa_kernels.reference import (
    FP8_KV_STORAGE,
    fp8_kv_cache,
    index_block_scores,
    kv_planes,
    new_kv_cache,
    sparse_attention,
    topk_blocks,
    write_paged,
)
from msa_kernels.selection_stats import READ_FRACTION_BUCKETS, SELECTION_FIELDS, add_selection_stats
from msa_kernels.shapes import PagedBatch
from msa_kernels.testing import bound_kv_cache, make_case, small_shape
from tests.naive_msa import naive_msa

# (q_lens, seq_lens): decode, prefill, chunked prefill, ragged mixes, lengths off the block grid,
# fewer blocks than k, a request with no new tokens.
BATCHES = {
    "decode": ([1, 1, 1], [37, 80, 129]),
    "prefill": ([70], [70]),
    "chunked_prefill": ([20, 33], [61, 100]),
    "ragged_mixed": ([1, 45, 1, 17, 0], [96, 45, 3, 50, 33]),
    "fewer_blocks_than_k": ([5, 1], [20, 9]),
}
SHAPES = {
    "gqa": small_shape(),
    "index_heads_gt_kv": small_shape(num_index_heads=4),
    "index_key_heads_2": small_shape(num_index_heads=4, num_index_key_heads=2),
    "init_and_two_local": small_shape(topk_blocks=4, local_blocks=2, init_blocks=1),
    "mha_one_index_head_per_query": small_shape(num_q_heads=4, num_kv_heads=4, num_index_heads=4, topk_blocks=2),
}


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_reference_matches_token_by_token_spec(shape_name, batch_name):
    shape = SHAPES[shape_name]
    q_lens, seq_lens = BATCHES[batch_name]
    seed = zlib.crc32(f"{shape_name}/{batch_name}".encode())
    case = make_case(shape, q_lens, seq_lens, dtype=torch.float64, seed=seed)
    out = torch.full_like(case.q, float("nan"))
    got, selected = msa_attention(
        case.q, case.index_q, case.kv_cache, case.index_key_cache, case.plan, shape, case.scale, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    for r in range(case.batch.num_requests):
        keys, values, index_keys, tokens = case.request_tokens(r)
        positions = list(range(seq_lens[r] - q_lens[r], seq_lens[r]))
        want, want_sel = naive_msa(
            case.q[tokens], case.index_q[tokens], keys, values, index_keys, positions, shape, case.scale
        )
        for t, per_head in enumerate(want_sel):
            for h, blocks in enumerate(per_head):
                row = selected[tokens][t, h].tolist()
                assert row == blocks + [-1] * (shape.topk_blocks - len(blocks)), (r, t, h)
        torch.testing.assert_close(got[tokens], want, rtol=1e-10, atol=1e-10)
    assert not torch.isnan(got).any()


@pytest.mark.parametrize("block_size", [16, 128])
def test_topk_covering_all_blocks_is_dense_attention(block_size):
    q_lens, seq_lens = [1, 300, 77], [1000, 300, 513]
    shape = small_shape(block_size=block_size, topk_blocks=-(-max(seq_lens) // block_size), num_index_heads=4)
    case = make_case(shape, q_lens, seq_lens, dtype=torch.float64, seed=block_size)
    got, selected = msa_attention(
        case.q, case.index_q, case.kv_cache, case.index_key_cache, case.plan, shape, case.scale
    )
    for r in range(len(q_lens)):
        _, _, _, tokens = case.request_tokens(r)
        torch.testing.assert_close(got[tokens], case.dense_causal(r), rtol=1e-12, atol=1e-12)
    # every visible block is selected, nothing else
    positions = case.batch.positions
    visible = (positions // block_size + 1).tolist()
    for t, n in enumerate(visible):
        assert selected[t, 0].tolist() == list(range(n)) + [-1] * (shape.topk_blocks - n)


def test_small_k_differs_from_dense_and_reads_only_selected_blocks():
    shape = small_shape(block_size=16, topk_blocks=2)
    case = make_case(shape, [1], [200], dtype=torch.float64, seed=3)
    got, selected = msa_attention(
        case.q, case.index_q, case.kv_cache, case.index_key_cache, case.plan, shape, case.scale
    )
    assert (got - case.dense_causal(0)).abs().max() > 1e-3
    # Poison every page the selection did not pick: the output must not change.
    chosen_pages = {int(case.batch.block_table[0, b]) for b in selected.flatten().tolist() if b >= 0}
    for page in range(case.kv_cache.shape[0]):
        if page not in chosen_pages:
            case.kv_cache[page] = float("nan")
    again = sparse_attention(case.q, case.kv_cache, case.batch, selected, shape, case.scale)
    torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_selection_is_sorted_and_forces_local_blocks():
    shape = small_shape(block_size=16, topk_blocks=4, local_blocks=2, init_blocks=1)
    case = make_case(shape, [3, 90], [250, 90], seed=5)
    scores = index_block_scores(case.index_q, case.index_key_cache, case.batch, shape)
    positions = case.batch.positions
    sel = topk_blocks(scores, positions, shape)
    for t, pos in enumerate(positions.tolist()):
        qb = pos // 16
        for h in range(shape.num_index_heads):
            row = [b for b in sel[t, h].tolist() if b >= 0]
            assert row == sorted(row) and len(set(row)) == len(row)
            assert {qb, max(0, qb - 1), 0} <= set(row)
            assert all(b <= qb for b in row)
            assert len(row) == min(4, qb + 1)
    # Invisible blocks score -inf; visible ones are finite.
    visible = torch.arange(scores.shape[-1])[None, :] <= (positions // 16)[:, None]
    assert torch.isfinite(scores.transpose(0, 1)[:, visible]).all()
    assert (scores.transpose(0, 1)[:, ~visible] == float("-inf")).all()


def test_float32_matches_float64_within_tolerance():
    shape = small_shape(block_size=128, topk_blocks=2, num_index_heads=4)
    case = make_case(shape, [1, 40], [700, 300], dtype=torch.float64, seed=11)
    want, sel64 = msa_attention(case.q, case.index_q, case.kv_cache, case.index_key_cache, case.plan, shape, case.scale)
    as32 = {k: getattr(case, k).float() for k in ("q", "index_q", "kv_cache", "index_key_cache")}
    got, sel32 = msa_attention(
        as32["q"], as32["index_q"], as32["kv_cache"], as32["index_key_cache"], case.plan, shape, case.scale
    )
    assert torch.equal(sel32, sel64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_write_paged_skips_padding_slots_and_handles_strided_views():
    cache = torch.zeros(3, 2, 4, 1, 2)
    values = torch.arange(10.0).view(5, 1, 2)
    slots = torch.tensor([5, -1, 0, 11, -1])
    write_paged(cache[:, 1], slots, values)
    flat = cache[:, 1].reshape(-1, 1, 2)
    assert flat[5].tolist() == [[0.0, 1.0]] and flat[0].tolist() == [[4.0, 5.0]] and flat[11].tolist() == [[6.0, 7.0]]
    assert cache[:, 0].abs().sum() == 0 and flat.abs().sum() == sum(range(8)) - 2 - 3


def test_kv_planes_reads_vllms_cache_layout_as_k_and_v_planes():
    """vLLM's K/V page [Hkv, B, 2 * D] holds a head's K and V of a token side by side; kv_planes' view
    [pages, 2, B, Hkv, D] reads them as planes, bound_kv_cache gives the tensor back."""
    shape = small_shape()
    bound = torch.randn(3, shape.num_kv_heads, shape.block_size, 2 * shape.head_dim)
    planes = kv_planes(bound)
    assert planes.shape == (3, 2, shape.block_size, shape.num_kv_heads, shape.head_dim)
    assert torch.equal(planes[2, 0, 5, 1], bound[2, 1, 5, : shape.head_dim])  # K of head 1, token 5 of page 2
    assert torch.equal(planes[2, 1, 5, 1], bound[2, 1, 5, shape.head_dim :])  # its V
    assert bound_kv_cache(planes).data_ptr() == bound.data_ptr() and torch.equal(bound_kv_cache(planes), bound)
    fresh = new_kv_cache(2, shape, torch.bfloat16, fill=1.5)
    assert bound_kv_cache(fresh).is_contiguous() and (fresh == 1.5).all()


def test_fp8_kv_cache_is_written_as_e4m3_of_value_over_scale_and_attended_dequantised():
    """An FP8 K/V cache (vLLM's uint8 storage): rows written as e4m3(x / scale), saturated at +-448; attention reads
    e4m3 x scale, so it equals attention on the dequantised values exactly, and the bf16 cache's within FP8's
    rounding."""
    shape = small_shape(num_index_heads=4)
    case = make_case(shape, [1, 45, 1], [96, 45, 300], dtype=torch.float32, seed=5)
    kv_scales = (0.5, 2.0)
    fp8_cache = fp8_kv_cache(case.kv_cache, kv_scales)
    dequantised = fp8_cache.view(torch.float8_e4m3fn).float() * torch.tensor(kv_scales).view(1, 2, 1, 1, 1)
    selected = ops.select_blocks(case.index_q, case.index_key_cache, case.plan, shape)
    args = (case.batch, selected, shape, case.scale)
    got = sparse_attention(case.q, fp8_cache, *args, kv_scales=kv_scales)
    assert torch.equal(got, sparse_attention(case.q, dequantised, *args))
    planned = (case.plan, selected, shape, case.scale)
    assert torch.equal(ops.sparse_attention(case.q, fp8_cache, *planned, kv_scales=kv_scales), got)
    full = sparse_attention(case.q, case.kv_cache, *args)
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(got.flatten(), full.flatten(), dim=0) > 0.999
    assert (got - full).norm() / full.norm() < 0.05  # e4m3 keeps 3 mantissa bits: ~2% per element
    huge = torch.full((1, 1, 1), 1e4)  # past 448 x scale: saturated, not inf
    cache = torch.zeros(1, 4, 1, 1, dtype=FP8_KV_STORAGE)
    write_paged(cache, torch.tensor([2]), huge, fp8_scale=2.0)
    assert cache.view(torch.float8_e4m3fn).float()[0, 2].item() == 448.0


def test_invalid_shapes_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="num_index_heads 3 must be a multiple of num_kv_heads 2"):
        small_shape(num_index_heads=3)
    with pytest.raises(ValueError, match="topk_blocks 1 < local_blocks 1 \\+ init_blocks 1"):
        small_shape(topk_blocks=1, init_blocks=1)


def test_paged_batch_positions():
    batch = PagedBatch(
        query_start_loc=torch.tensor([0, 1, 4, 4]), seq_lens=torch.tensor([10, 3, 7]), block_table=torch.zeros(3, 1)
    )
    assert batch.positions.tolist() == [9, 0, 1, 2]


def _two_phase_batch(device: str = "cpu") -> PagedBatch:
    """Two decode requests, then a 38-token prefill."""
    return PagedBatch(
        query_start_loc=torch.tensor([0, 1, 2, 40], device=device),
        seq_lens=torch.tensor([9, 300, 40], device=device),
        block_table=torch.zeros(3, 3, dtype=torch.int32, device=device),
    )


def test_workspace_is_one_tensor_per_use_and_size_that_every_layer_of_the_step_shares():
    plan = StepPlan.of(_two_phase_batch())
    decode, prefill = plan.parts
    partials = decode.workspace.split_outputs((4, 2, 8, 16))
    assert partials.shape == (4, 2, 8, 16) and partials.dtype == torch.float32
    assert decode.workspace.split_outputs((4, 2, 8, 16)) is partials  # the next layer's
    assert decode.workspace.split_outputs((2, 2, 8, 16)) is not partials  # another split count
    lse = decode.workspace.split_log_sum_exps((4, 2, 8))
    assert lse.dtype == torch.float32 and lse.data_ptr() != partials.data_ptr()
    assert prefill.workspace.split_outputs((4, 2, 8, 16)) is not partials  # another part
    scores = decode.workspace.block_scores((2, 2, 3))
    assert scores.dtype == torch.float32 and decode.workspace.block_scores((2, 2, 3)) is scores
    selection = plan.workspace.selection((40, 2, 3))
    assert selection.dtype == torch.int32 and plan.workspace.selection((40, 2, 3)) is selection
    assert StepPlan.of(_two_phase_batch()).workspace.selection((40, 2, 3)) is not selection  # another step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_workspace_made_during_cuda_graph_capture_is_kept_apart_from_eager_workspace():
    workspace = StepPlan.of(_two_phase_batch("cuda")).parts[0].workspace
    eager = workspace.block_scores((2, 4, 3))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = workspace.block_scores((2, 4, 3))
        assert workspace.block_scores((2, 4, 3)) is captured
        captured.zero_()  # a kernel in the graph, as a layer's would be
    assert captured is not eager and captured.data_ptr() != eager.data_ptr()
    assert workspace.block_scores((2, 4, 3)) is eager


def test_request_tiles_cover_each_request_in_runs_of_consecutive_tokens():
    # requests of 1, 0, 129, 128 and 5 query tokens
    batch = PagedBatch(
        query_start_loc=torch.tensor([0, 1, 1, 130, 258, 263]),
        seq_lens=torch.tensor([9, 4, 300, 128, 5]),
        block_table=torch.zeros(5, 3, dtype=torch.int32),
    )
    tiles = batch.request_tiles(64)
    assert tiles.dtype == torch.int32
    assert tiles.tolist() == [
        [0, 0, 1],
        [2, 1, 65],
        [2, 65, 129],
        [2, 129, 130],
        [3, 130, 194],
        [3, 194, 258],
        [4, 258, 263],
    ]
    assert batch.request_tiles(64) is tiles  # built once per batch: the layers of a step share it
    assert batch.request_tiles(4)[:, 2].sub(batch.request_tiles(4)[:, 1]).sum() == 263  # every token once


def test_padded_batch_tokens_sit_at_position_minus_one_and_select_nothing():
    """A CUDA graph replays on vLLM's padded batch: 2 real requests, 2 padding ones (seq_len 0)."""
    shape = small_shape()
    batch = PagedBatch(
        query_start_loc=torch.tensor([0, 1, 2, 2, 2]),
        seq_lens=torch.tensor([300, 129, 0, 0]),
        block_table=torch.zeros(4, 3, dtype=torch.int32),
        query_start_loc_cpu=[0, 1, 2, 3, 4],  # the graph's token count: 4, two of them padding
    )
    assert batch.token_requests.tolist() == [0, 1, 3, 3]
    assert batch.positions.tolist() == [299, 128, -1, -1]
    selected = topk_blocks(torch.randn(4, shape.num_index_heads, 3), batch.positions, shape)
    assert (selected[2:] == -1).all() and (selected[:2, :, 0] >= 0).all()


class DeviceOps(TorchDispatchMode):
    """The names of the ops dispatched inside the block that make or write a tensor (each a kernel on a GPU): views
    left out."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func).removeprefix("aten."))
        return func(*args, **(kwargs or {}))


def test_token_requests_and_positions_take_eight_device_ops():
    """A decode step computes them once for all its layers, but each op is a kernel launch on the step's path (and
    in its CUDA graph): the token count shared, int32 throughout (no conversion), padding masked in place."""
    batch = PagedBatch(
        query_start_loc=torch.tensor([0, 1, 4, 4], dtype=torch.int32),
        seq_lens=torch.tensor([10, 300, 0], dtype=torch.int32),
        block_table=torch.zeros(3, 3, dtype=torch.int32),
        query_start_loc_cpu=[0, 1, 4, 5],
    )
    with DeviceOps() as counted:
        positions, requests = batch.positions, batch.token_requests
    assert positions.tolist() == [9, 297, 298, 299, -1] and requests.tolist() == [0, 1, 1, 1, 2]
    assert positions.dtype == requests.dtype == torch.int32
    assert sorted(counted.ops) == sorted(
        ["arange.default", "searchsorted.Tensor", "clamp_.default", "sub.Tensor", "index_select.default", "add_.Tensor"]
        + ["ge.Tensor", "masked_fill_.Scalar"]
    )


def test_topk_blocks_takes_the_lower_block_among_equal_scores():
    shape = small_shape(topk_blocks=3, init_blocks=0, local_blocks=1)
    # token at position 100 (block 6 of 16-token blocks); blocks 1, 2, 4 and 5 tie at the top score
    scores = torch.tensor([[[0.0, 2.0, 2.0, 1.0, 2.0, 2.0, -5.0] + [float("-inf")] * 3]]).expand(1, 2, 10)
    got = topk_blocks(scores, torch.tensor([100]), shape)
    assert got.tolist() == [[[1, 2, 6], [1, 2, 6]]]


def _mixed_batch() -> PagedBatch:
    """Decodes first as vLLM orders them (one with no new token), then prefill chunks (one a single token)."""
    q_lens, seq_lens = [1, 1, 0, 45, 1, 17], [37, 80, 5, 45, 129, 60]
    return PagedBatch(
        query_start_loc=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.arange(6 * 9, dtype=torch.int32).view(6, 9),
    )


def test_split_rebases_the_prefill_part_onto_views_of_the_batch(monkeypatch):
    batch = _mixed_batch()
    whole_positions, whole_requests = batch.positions, batch.token_requests
    assert batch.query_start_loc_cpu == [0, 1, 2, 2, 47, 48, 65]  # the host copy vLLM's builder sets
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: pytest.fail("split synced the device"))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("split synced the device"))
    decode, prefill = batch.split()
    monkeypatch.undo()
    assert (decode.phase, prefill.phase, batch.phase) == ("decode", "prefill", "mixed")
    assert decode.query_start_loc_cpu == decode.query_start_loc.tolist() == [0, 1, 2, 2]
    assert prefill.query_start_loc_cpu == prefill.query_start_loc.tolist() == [0, 45, 46, 63]
    assert (decode.num_tokens, prefill.num_tokens, prefill.num_requests) == (2, 63, 3)
    assert decode.query_start_loc.data_ptr() == batch.query_start_loc.data_ptr()
    for part, first in ((decode, 0), (prefill, 3)):
        assert part.seq_lens.data_ptr() == batch.seq_lens[first].data_ptr()
        assert part.block_table.data_ptr() == batch.block_table[first].data_ptr()
        assert part.seq_lens_cpu == batch.seq_lens_cpu[first : first + part.num_requests]
    assert torch.equal(torch.cat([decode.positions, prefill.positions]), whole_positions)
    assert torch.equal(torch.cat([decode.token_requests, prefill.token_requests + 3]), whole_requests)
    assert prefill.request_tiles(16).tolist() == [
        [0, 0, 16],
        [0, 16, 32],
        [0, 32, 45],
        [1, 45, 46],
        [2, 46, 62],
        [2, 62, 63],
    ]
    # vLLM's count of decodes, where it differs: the 0-token request then leads the prefill part
    decode, prefill = batch.split(num_decode_requests=2)
    assert decode.query_start_loc_cpu == [0, 1, 2] and prefill.query_start_loc.tolist() == [0, 0, 45, 46, 63]
    with pytest.raises(ValueError, match="split takes a mixed batch"):
        prefill.split()


def test_step_plan_splits_once_and_gives_each_part_its_rows_and_workspace():
    batch = _mixed_batch()
    plan = StepPlan.of(batch, num_decode_requests=2)  # as vLLM's builder plans a step
    decode, prefill = plan.parts
    assert (decode.phase, decode.rows, prefill.phase, prefill.rows) == ("decode", slice(0, 2), "prefill", slice(2, 65))
    assert decode.batch.query_start_loc_cpu == [0, 1, 2] and prefill.batch.query_start_loc_cpu == [0, 0, 45, 46, 63]
    assert plan.part("decode") is decode and plan.num_decode_tokens == 2
    assert decode.workspace is not prefill.workspace and plan.workspace not in (decode.workspace, prefill.workspace)
    rows = torch.arange(65)
    assert torch.equal(torch.cat([decode.of(rows), prefill.of(rows)]), rows)
    only_decodes = StepPlan.of(batch, num_decode_requests=6)  # a part without the other: all the rows, unsliced
    assert [part.phase for part in only_decodes.parts] == ["decode"] and only_decodes.parts[0].rows is None
    assert only_decodes.parts[0].of(rows) is rows and StepPlan.of(batch).num_decode_tokens == 2
    assert only_decodes.positions is only_decodes.parts[0].batch.positions  # what its kernels computed
    assert torch.equal(only_decodes.positions, batch.positions) and torch.equal(plan.positions, batch.positions)


def test_split_counts_speculative_verification_requests_as_decodes():
    """Verifying 3 drafted tokens: requests bring up to 4 tokens (fewer where the drafter proposed fewer)."""
    q_lens, seq_lens = [4, 1, 4, 3, 45, 17], [37, 80, 300, 129, 45, 60]

    def batch():
        return PagedBatch(
            query_start_loc=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.arange(6 * 3, dtype=torch.int32).view(6, 3),
        )

    decode, prefill = batch().split(max_decode_query_len=4)
    assert decode.query_start_loc_cpu == [0, 4, 5, 9, 12] and prefill.query_start_loc_cpu == [0, 45, 62]
    assert decode.positions.tolist() == [33, 34, 35, 36, 79, 296, 297, 298, 299, 126, 127, 128]
    none, everything = batch().split()  # single-token decodes: the first request already is no decode
    assert none is None and everything.num_tokens == 74


def test_split_of_one_phase_or_no_tokens_gives_one_part_or_none():
    decodes = PagedBatch(
        query_start_loc=torch.tensor([0, 1, 2, 3]),
        seq_lens=torch.tensor([9, 200, 3]),
        block_table=torch.zeros(3, 2, dtype=torch.int32),
    )
    part, none = decodes.split()
    assert none is None and part.phase == "decode"
    assert part.query_start_loc.data_ptr() == decodes.query_start_loc.data_ptr()
    prefills = PagedBatch(
        query_start_loc=torch.tensor([0, 7, 10]),
        seq_lens=torch.tensor([7, 300]),
        block_table=torch.zeros(2, 3, dtype=torch.int32),
    )
    none, part = prefills.split()
    assert none is None and part.phase == "prefill" and part.query_start_loc.tolist() == [0, 7, 10]
    empty = PagedBatch(
        query_start_loc=torch.tensor([0, 0]),
        seq_lens=torch.tensor([4]),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
    )
    assert empty.split() == (None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ops_on_a_mixed_batch_equals_its_decode_and_prefill_parts_run_separately(dtype):
    shape = small_shape(num_index_heads=4, topk_blocks=2)
    q_lens, seq_lens = [1, 1, 0, 45, 1, 17], [37, 80, 5, 45, 129, 60]
    case = make_case(shape, q_lens, seq_lens, dtype=dtype, seed=17)
    caches = (case.kv_cache, case.index_key_cache)
    out = torch.full_like(case.q, float("nan"))
    got, selected = msa_attention(case.q, case.index_q, *caches, case.plan, shape, case.scale, out=out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
    scores = ops.index_block_scores(case.index_q, case.index_key_cache, case.plan, shape)
    assert [(part.phase, part.rows) for part in case.plan.parts] == [
        ("decode", slice(0, 2)),
        ("prefill", slice(2, case.batch.num_tokens)),
    ]
    for part in case.plan.parts:
        alone = StepPlan.of(part.batch)
        part_out, part_selected = msa_attention(
            part.of(case.q), part.of(case.index_q), *caches, alone, shape, case.scale
        )
        assert torch.equal(part.of(got), part_out) and torch.equal(part.of(selected), part_selected)
        part_scores = ops.index_block_scores(part.of(case.index_q), case.index_key_cache, alone, shape)
        assert torch.equal(part.of(scores), part_scores)
    # out=: the selection of a mixed batch written into rows of a larger tensor, nothing outside them
    step = torch.full((case.batch.num_tokens + 2, shape.num_index_heads, shape.topk_blocks), 7777, dtype=torch.int32)
    into = ops.select_blocks(case.index_q, case.index_key_cache, case.plan, shape, out=step[1:-1])
    assert into.data_ptr() == step[1:-1].data_ptr() and torch.equal(step[1:-1], selected)
    assert (step[[0, -1]] == 7777).all()


@pytest.mark.parametrize("max_tokens", [1, 7, 16, 45])
def test_token_chunks_keep_every_tokens_position_and_request(max_tokens):
    q_lens, seq_lens = [45, 3, 17, 1], [45, 80, 60, 129]
    batch = make_case(small_shape(), q_lens, seq_lens, seed=3).batch
    chunks = batch.token_chunks(max_tokens)
    assert [rows.start for rows, _ in chunks] == list(range(0, batch.num_tokens, max_tokens))
    assert all(chunk.num_tokens <= max_tokens for _, chunk in chunks)
    for rows, chunk in chunks:
        assert torch.equal(chunk.positions, batch.positions[rows])
        pages = chunk.block_table[chunk.token_requests.long()]
        assert torch.equal(pages, batch.block_table[batch.token_requests.long()][rows])


def test_select_blocks_scores_a_long_prefill_in_token_chunks_with_the_same_selection(monkeypatch):
    shape = small_shape(num_index_heads=4, topk_blocks=2)
    q_lens, seq_lens = [1, 1, 45, 17, 60], [37, 80, 45, 60, 200]  # two decodes, then chunked prefills
    case = make_case(shape, q_lens, seq_lens, seed=29)
    whole = ops.select_blocks(case.index_q, case.index_key_cache, case.plan, shape)
    row_bytes = shape.num_index_heads * case.batch.block_table.shape[1] * 4
    monkeypatch.setattr(ops, "SCORE_BYTES", 10 * row_bytes)  # runs of 10 prefill tokens: requests cut mid-way
    prefill = case.plan.parts[1].batch
    assert len(ops._score_chunks(prefill, shape)) == -(-prefill.num_tokens // 10)
    assert torch.equal(ops.select_blocks(case.index_q, case.index_key_cache, case.plan, shape), whole)


def selection_totals_by_definition(selected, positions, block_size, decode_tokens, layers):
    """msa_kernels.selection_stats' module docstring, selection by selection in Python."""
    totals = dict.fromkeys(SELECTION_FIELDS, 0.0)
    for token, heads in enumerate(selected.tolist()):
        position = int(positions[token])
        for blocks in heads:
            if position < 0:
                continue
            count = sum(block >= 0 for block in blocks)
            read = count * block_size - (block_size - 1 - position % block_size)
            fraction = read / (position + 1)
            bucket = next(
                (f"read_fraction_le_{b}" for b in READ_FRACTION_BUCKETS if fraction <= b), "read_fraction_inf"
            )
            for field, value in [
                ("selections", 1),
                ("decode_selections", token < decode_tokens),
                ("selected_blocks", count),
                ("context_tokens", position + 1),
                ("read_tokens", read),
                ("read_fraction_sum", fraction),
                (bucket, 1),
            ]:
                totals[field] += value * layers
    return torch.tensor([totals[field] for field in SELECTION_FIELDS], dtype=torch.float64)


def random_selection(num_tokens, num_heads, topk, block_size, generator, padding=0):
    """Selections as top-k leaves them: each token's own block, then up to topk - 1 earlier ones (-1 past the
    visible blocks); positions across a few blocks, the last `padding` tokens a CUDA graph's (-1)."""
    positions = torch.randint(0, 12 * block_size, (num_tokens,), generator=generator, dtype=torch.int32)
    positions[num_tokens - padding :] = -1
    selected = torch.full((num_tokens, num_heads, topk), -1, dtype=torch.int32)
    for token, position in enumerate(positions.tolist()):
        own = max(position, 0) // block_size
        for head in range(num_heads):
            earlier = torch.randperm(own, generator=generator)[: torch.randint(0, topk, (1,), generator=generator)]
            selected[token, head, : 1 + len(earlier)] = torch.cat([torch.tensor([own]), earlier])
    return selected, positions


def test_selection_totals_add_each_selection_as_the_metrics_define_it():
    """Decode tokens then prefill tokens then padding, selections full and short (fewer blocks than k), added twice:
    the integer counts exact, the read-fraction sum to rounding."""
    generator = torch.Generator().manual_seed(7)
    selected, positions = random_selection(40, 3, 5, 16, generator, padding=4)
    totals = torch.zeros(len(SELECTION_FIELDS), dtype=torch.float64)
    for _ in range(2):
        add_selection_stats(totals, selected, positions, block_size=16, decode_tokens=10, layers=3)
    want = 2 * selection_totals_by_definition(selected, positions, 16, 10, 3)
    fraction_sum = SELECTION_FIELDS.index("read_fraction_sum")
    exact = [i for i in range(len(SELECTION_FIELDS)) if i != fraction_sum]
    assert torch.equal(totals[exact], want[exact]) and want[0] == 2 * 3 * 36 * 3
    assert torch.isclose(totals[fraction_sum], want[fraction_sum], rtol=1e-12)
    assert (want[fraction_sum + 1 :] > 0).sum() >= 3  # the selections fall in several buckets
