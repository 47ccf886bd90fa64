"""CuTeDSL kernels: compile every variant for sm_90a everywhere (CI has no GPU), match the reference on a GPU."""

import os
from dataclasses import replace

import pytest
import torch

from msa_kernels import reference
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache, page_bytes, quantize_rows
from msa_kernels.plan import Workspace
from msa_kernels.shapes import M3_SHAPE, MSAShape
from msa_kernels.stand_ins import SignatureCheck, check_arguments, stand_in_kernels
from msa_kernels.testing import make_case

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

import cutlass

from msa_kernels.cute import (
    index_key_write,
    index_scores,
    index_scores_fp8,
    index_scores_prefill,
    page_copy,
    page_resolve,
    selection_stats,
    sparse_attn,
    sparse_attn_prefill,
    topk_blocks,
)
from msa_kernels.cute.combine import CombineKernel, CombineParams
from msa_kernels.cute.fake import row_major
from msa_kernels.cute.index_key_write import IndexKeyWriteKernel, IndexKeyWriteParams
from msa_kernels.cute.index_scores import IndexScoreKernel, IndexScoreParams
from msa_kernels.cute.index_scores_fp8 import Fp8IndexScoreKernel, Fp8IndexScoreParams
from msa_kernels.cute.index_scores_prefill import PrefillIndexScoreKernel, PrefillIndexScoreParams
from msa_kernels.cute.page_copy import PageCopyKernel, PageCopyParams
from msa_kernels.cute.page_resolve import PageResolveKernel, PageResolveParams
from msa_kernels.cute.runtime import compiled_kernel
from msa_kernels.cute.selection_stats import SelectionStatsKernel, SelectionStatsParams
from msa_kernels.cute.sparse_attn import SparseAttentionKernel, SparseAttentionParams
from msa_kernels.cute.sparse_attn_prefill import PrefillAttentionKernel, PrefillAttentionParams
from msa_kernels.cute.topk_blocks import TopkBlocksKernel, TopkBlocksParams

# (Hi, Hki, Dp); the last: 2 heads a CTA, 2 stages
INDEX_SCORE_PARAMS = [(4, 1, 128), (8, 2, 64), (4, 4, 32), (2, 1, 256)]


@pytest.fixture
def sm90a(monkeypatch, tmp_path):
    """Compile for Hopper even without a GPU, into a fresh kernel cache."""
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    monkeypatch.setenv("VLLM_MSA_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def compiles_and_caches(kernel_cls, params, cache_dir):
    """Compile through msa_kernels.cute.runtime.compiled_kernel, then load the exported object file back."""
    compile_kernel = compiled_kernel.__wrapped__  # past the in-process cache
    assert compile_kernel(kernel_cls, params) is not None
    [cached] = cache_dir.glob(f"{kernel_cls.__name__}_*.o")
    assert compile_kernel(kernel_cls, params) is not None  # this one loads the file
    return cached


@pytest.mark.parametrize("hi, hki, dp", INDEX_SCORE_PARAMS)
def test_index_score_kernels_compile_for_sm90a(hi, hki, dp, sm90a):
    compiles_and_caches(IndexScoreKernel, IndexScoreParams(hi, hki, dp), sm90a)
    compiles_and_caches(PrefillIndexScoreKernel, PrefillIndexScoreParams(hi, hki, dp), sm90a)


@pytest.mark.parametrize("hi, hki, dp", INDEX_SCORE_PARAMS)
def test_index_score_kernel_with_16_key_elements_a_lane_compiles_for_sm90a(hi, hki, dp, sm90a):
    compiles_and_caches(IndexScoreKernel, IndexScoreParams(hi, hki, dp, lane_elems=16), sm90a)


@pytest.mark.parametrize("hi, hki, dp", INDEX_SCORE_PARAMS)
def test_fp8_index_score_kernel_compiles_for_sm90a(hi, hki, dp, sm90a):
    compiles_and_caches(Fp8IndexScoreKernel, Fp8IndexScoreParams(hi, hki, dp), sm90a)


@pytest.mark.parametrize("hi, hki, dp", INDEX_SCORE_PARAMS)
def test_fp8_prefill_index_score_kernel_compiles_for_sm90a(hi, hki, dp, sm90a):
    compiles_and_caches(PrefillIndexScoreKernel, PrefillIndexScoreParams(hi, hki, dp, fp8=True), sm90a)


INDEX_KEY_WRITE_PARAMS = [
    (1, 128, True),
    (2, 64, True),
    (4, 32, True),
    (1, 256, True),
    (1, 128, False),
    (2, 64, False),
    (1, 1024, False),
]  # (Hki, Dp, fp8); bf16 rows span up to a CTA


@pytest.mark.parametrize("hki, dp, fp8", INDEX_KEY_WRITE_PARAMS)
def test_index_key_write_kernel_compiles_for_sm90a(hki, dp, fp8, sm90a):
    compiles_and_caches(IndexKeyWriteKernel, IndexKeyWriteParams(hki, dp, fp8), sm90a)


@pytest.mark.parametrize(
    "kernel_cls, params",
    [
        (Fp8IndexScoreKernel, Fp8IndexScoreParams(4, 1, 128)),
        (IndexKeyWriteKernel, IndexKeyWriteParams(1, 128, fp8=True)),
    ],
    ids=["index_scores", "index_key_write"],
)
def test_fp8_kernels_round_as_the_reference_in_their_ptx(kernel_cls, params, sm90a):
    """What makes the kernels' e4m3 bytes the reference's (msa_kernels/cute/fp8_rows.py): IEEE divisions, never an
    approximate one, and one round-to-nearest-even saturating cvt from float32, never through f16."""
    import cutlass.cute as cute

    compiled = cute.compile(
        kernel_cls(params), *kernel_cls.fake_arguments(params), options=f"--keep-ptx --dump-dir={sm90a}"
    )
    ptx = compiled.__ptx__
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
    assert "div.approx" not in ptx and "div.full" not in ptx and "e4m3x2.f16x2" not in ptx


@pytest.mark.parametrize(
    "kernel_cls, params",
    [
        (IndexScoreKernel, IndexScoreParams(4, 1, 128)),
        (Fp8IndexScoreKernel, Fp8IndexScoreParams(4, 1, 128)),
        (TopkBlocksKernel, TopkBlocksParams(16, 1, 0, row_threads=512)),
        (TopkBlocksKernel, TopkBlocksParams(16, 1, 0, row_threads=32)),
        (SparseAttentionKernel, SparseAttentionParams(64, 4, 4, 128, split=True)),
        (CombineKernel, CombineParams(64, 128, 32)),
    ],
    ids=["index_scores", "index_scores_fp8", "topk_cta", "topk_warp", "sparse_attention", "combine"],
)
def test_decode_chain_kernels_wait_for_the_previous_kernel_first(kernel_cls, params, sm90a, monkeypatch):
    """Launched with programmatic dependent launch (msa_kernels/cute/pdl.py), a kernel may start before the one it
    reads from has finished: its launch must carry the attribute (the host IR), and before griddepcontrol.wait
    its PTX may only read its parameters and compute (no memory access, branch or call of any kind)."""
    import re

    import cutlass.cute as cute
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar  # keep the host IR (what CUTE_DSL_KEEP_IR=1 does at start-up)
    monkeypatch.setattr(envar, "keep_ir", True)
    monkeypatch.setattr(envar, "dump_dir", str(sm90a))
    compiled = cute.compile(
        kernel_cls(params), *kernel_cls.fake_arguments(params), options=f"--keep-ptx --dump-dir={sm90a}"
    )
    assert re.search(r"programmatic_stream_serialization_allowed\[%\d+\] %c1_i32", compiled.__mlir__)
    body = compiled.__ptx__[compiled.__ptx__.index(".entry") :]
    assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body
    before = body[body.index("{") : body.index("griddepcontrol.wait")]
    instructions = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", before, re.M)
    computing = r"(ld\.param|mov|cvta\.to\.global|shfl\.sync|add|sub|mul|mad|and|or|xor|shl|shr|setp|selp|cvt)\b"
    assert all(re.match(computing, op) for op in instructions), instructions
    assert not re.search(r"^\s*(\$L__\w+:|bra\b|call\b)", before, re.M)


# (Hq, Hkv, Hi, D): M3; the demo model; a partial 16-row tile (m = 12); two tiles per index head
# (m = 32); Hi > Hkv (m = 4)
ATTENTION_PARAMS = [(64, 4, 4, 128), (8, 2, 4, 32), (48, 4, 4, 128), (64, 2, 2, 64), (16, 2, 4, 64)]


@pytest.mark.parametrize("hq, hkv, hi, d", ATTENTION_PARAMS)
@pytest.mark.parametrize("split", [False, True])
def test_sparse_attention_kernel_compiles_for_sm90a(hq, hkv, hi, d, split, sm90a):
    params = SparseAttentionParams(hq, hkv, hi, d, split=split)
    compiles_and_caches(SparseAttentionKernel, params, sm90a)


def test_decode_split_k_fills_the_gpu_and_bounds_its_partials():
    """M3 at 396 resident CTAs (an H100/H200): batch 1 spreads its 32 tiles over 32 splits, batch 32 takes 3 splits
    of 11 (one wave); a 128K-token prefill over an FP8 K/V cache (4 GiB of fp32 partials a split) runs unsplit."""
    params = SparseAttentionParams(64, 4, 4, 128)
    tiles = 16 * params.tiles_per_block
    assert sparse_attn.num_splits(1, params, tiles, 396) == (32, 1)
    assert sparse_attn.num_splits(32, params, tiles, 396) == (3, 11)
    assert sparse_attn.num_splits(131072, params, tiles, 396) == (1, 32)
    splits, _ = sparse_attn.num_splits(4096, params, tiles, 396)
    assert splits > 1 and splits * 4096 * 64 * 128 * 4 <= sparse_attn.PARTIAL_BYTES


@pytest.mark.parametrize("hq, hkv, hi, d", [(64, 4, 4, 128), (8, 2, 4, 32)])
@pytest.mark.parametrize("split", [False, True])
def test_fp8_kv_sparse_attention_kernel_compiles_for_sm90a(hq, hkv, hi, d, split, sm90a):
    params = SparseAttentionParams(hq, hkv, hi, d, split=split, fp8_kv=True)
    compiles_and_caches(SparseAttentionKernel, params, sm90a)


def prefill_attention_serves(hq: int, hi: int, d: int, block_size: int, dtype=torch.bfloat16) -> bool:
    return PrefillAttentionKernel.can_implement(dtype, hq, hi, d, block_size)


PREFILL_PARAMS = [p for p in ATTENTION_PARAMS if prefill_attention_serves(p[0], p[2], p[3], 128)]


def test_prefill_attention_serves_m3_and_refuses_what_it_cannot_tile():
    assert PREFILL_PARAMS == [(64, 4, 4, 128), (64, 2, 2, 64), (16, 2, 4, 64)]  # m = 16, 32, 4
    assert not prefill_attention_serves(48, 4, 128, 128)  # m = 12 does not divide 64
    assert not prefill_attention_serves(8, 4, 32, 128)  # m = 2: 32 tokens per tile; D 32
    assert not prefill_attention_serves(64, 4, 128, 64)  # 64-token blocks
    assert not prefill_attention_serves(64, 4, 128, 128, dtype=torch.float16)  # bf16 only


@pytest.mark.parametrize("hq, hkv, hi, d", PREFILL_PARAMS)
def test_prefill_attention_kernel_compiles_for_sm90a(hq, hkv, hi, d, sm90a):
    compiles_and_caches(PrefillAttentionKernel, PrefillAttentionParams(hq, hkv, hi, d, topk_blocks=16), sm90a)


@pytest.mark.parametrize("hq, d, splits", [(64, 128, 32), (64, 128, 2), (8, 32, 64)])
def test_combine_kernel_compiles_for_sm90a(hq, d, splits, sm90a):
    compiles_and_caches(CombineKernel, CombineParams(hq, d, splits), sm90a)


TOPK_PARAMS = [(16, 1, 0), (4, 1, 0), (8, 2, 1), (5, 3, 2)]  # (K, L, I): M3, the demo, init + local variants


@pytest.mark.parametrize("k, local, init", TOPK_PARAMS)
def test_topk_kernel_compiles_for_sm90a(k, local, init, sm90a):
    compiles_and_caches(TopkBlocksKernel, TopkBlocksParams(k, local, init), sm90a)


@pytest.mark.parametrize("row_threads", [32, 1024])
def test_topk_kernel_compiles_with_a_warp_or_a_large_cta_per_row(row_threads, sm90a):
    compiles_and_caches(TopkBlocksKernel, TopkBlocksParams(16, 1, 0, row_threads=row_threads), sm90a)


def test_kernel_cache_replaces_an_unreadable_file(sm90a):
    cached = compiles_and_caches(CombineKernel, CombineParams(8, 32, 2), sm90a)
    cached.write_bytes(b"not an object file")
    cached = compiles_and_caches(CombineKernel, CombineParams(8, 32, 2), sm90a)
    assert cached.stat().st_size > 1000


def test_compiled_kernels_refuse_misaligned_tensors(sm90a):
    """The compiled function checks its tensors against kernels/msa_kernels/cute/fake.py before it touches the GPU: a
    base address off the 16-byte alignment partial_out declares is a ValueError, compiled and loaded."""
    params = CombineParams(8, 32, 2)
    misaligned = torch.zeros(2 * 3 * 8 * 32 + 1)[1:].view(2, 3, 8, 32)
    lse, out = torch.zeros(2, 3, 8), torch.zeros(3, 8, 32, dtype=torch.bfloat16)
    compile_kernel = compiled_kernel.__wrapped__
    for combine in (compile_kernel(CombineKernel, params), compile_kernel(CombineKernel, params)):  # the 2nd loads
        with pytest.raises(ValueError, match="Misaligned Tensor data on argument #0.*alignment=16 bytes"):
            combine(misaligned, lse, out)


# The launchers on any machine: each compiled kernel a stand-in that checks what it is passed against the kernel's
# symbolic arguments (msa_kernels.stand_ins.SignatureCheck), as the compiled function checks it on the GPU.
LAUNCH_BATCHES = {  # (q_lens, seq_lens) at MiniMax-M3's layer shape
    "decode": ([1, 1, 1], [129, 4000, 700]),
    "prefill": ([300, 70], [300, 1000]),
    "mixed": ([1, 1, 300], [500, 2000, 1300]),
}


@pytest.fixture
def launches():
    """ops routed as on a Hopper GPU, every compiled kernel a SignatureCheck stand-in, for the test's duration."""
    check = SignatureCheck()
    with stand_in_kernels(check):
        yield check


def launch_case(batch_name: str):
    q_lens, seq_lens = LAUNCH_BATCHES[batch_name]
    return make_case(M3_SHAPE, q_lens, seq_lens, dtype=torch.bfloat16, seed=len(batch_name))


@pytest.mark.parametrize("index_keys", ["bf16", "fp8"])
@pytest.mark.parametrize("batch_name", LAUNCH_BATCHES)
def test_a_layer_call_passes_each_kernel_what_its_signature_takes(batch_name, index_keys, launches, monkeypatch):
    """ops.msa_attention as a served layer calls it (the prefill index scores in two chunks of tokens)."""
    from msa_kernels import ops

    case = launch_case(batch_name)
    index_key_cache = case.index_key_cache if index_keys == "bf16" else fp8_pages(case.index_key_cache)
    row_bytes = M3_SHAPE.num_index_heads * case.batch.block_table.shape[1] * 4
    monkeypatch.setattr(ops, "SCORE_BYTES", 200 * row_bytes)  # a 370-token prefill part scores in two runs
    out = torch.empty_like(case.q)
    ops.msa_attention(case.q, case.index_q, case.kv_cache, index_key_cache, case.plan, M3_SHAPE, case.scale, out=out)
    index_kernel = {"bf16": "IndexScoreKernel", "fp8": "Fp8IndexScoreKernel"}[index_keys]
    want = {
        "decode": {index_kernel, "TopkBlocksKernel", "SparseAttentionKernel", "CombineKernel"},
        "prefill": {"PrefillIndexScoreKernel", "TopkBlocksKernel", "PrefillAttentionKernel"},
    }
    want["mixed"] = want["decode"] | want["prefill"]
    assert set(launches.kernels()) == want[batch_name]
    if batch_name == "prefill":
        assert launches.kernels().count("PrefillIndexScoreKernel") == 2
    fp8_params = [launch.params.fp8 for launch in launches.launches if launch.kernel == "PrefillIndexScoreKernel"]
    assert all(fp8 == (index_keys == "fp8") for fp8 in fp8_params)


@pytest.mark.parametrize("batch_name", LAUNCH_BATCHES)
def test_the_layers_of_a_step_bind_its_launches_once(batch_name, launches, monkeypatch):
    """The first layer call of a step works out what its kernels take from the step (splits, tiles, score chunks,
    work tensors); the next layer's call, on other tensors, launches the same kernels on the same step tensors
    without working any of it out again."""
    from msa_kernels import ops
    from msa_kernels.shapes import PagedBatch

    case = launch_case(batch_name)
    chosen = ops.kernels(case.q.device, case.q.dtype, case.q.dtype, False, M3_SHAPE)

    def layer_call(q, index_q, kv_cache, index_key_cache, out):
        selected = chosen.select_blocks(
            index_q, index_key_cache, case.plan, out=ops.layer_selection(case.plan, M3_SHAPE)
        )
        chosen.sparse_attention(q, kv_cache, case.plan, selected, case.scale, out=out)

    inputs = [case.q.contiguous(), case.index_q.contiguous(), case.kv_cache, case.index_key_cache]
    inputs.append(torch.empty(case.q.shape, dtype=case.q.dtype))  # the layer's output
    layer_call(*inputs)
    first = list(launches.launches)

    def worked_out_again(*args, **kwargs):
        raise AssertionError("a step's launch worked out again by a later layer")

    for owner, name in [(ops, "_score_chunks"), (sparse_attn, "_launch_plan"), (topk_blocks, "row_threads")]:
        monkeypatch.setattr(owner, name, worked_out_again)
    monkeypatch.setattr(PagedBatch, "request_tiles", worked_out_again)
    other = [t.clone() for t in inputs]  # the next layer's
    layer_call(*other)
    second = launches.launches[len(first) :]
    assert [launch.kernel for launch in second] == [launch.kernel for launch in first]
    layer_inputs = {t.untyped_storage().data_ptr() for t in (*inputs, *other)}  # and their views
    for a, b in zip(first, second):
        for x, y in zip(a.args, b.args):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in layer_inputs:
                assert x.data_ptr() == y.data_ptr(), f"{a.kernel}: a step tensor moved between layers"


@pytest.mark.parametrize("batch_name", ["decode", "prefill"])
def test_an_fp8_kv_cache_reaches_the_per_token_kernel_as_e4m3(batch_name, launches):
    from msa_kernels import ops

    case = launch_case(batch_name)
    fp8 = reference.fp8_kv_cache(case.kv_cache, (0.5, 2.0))
    fp8_kv_kernels = ops.kernels(case.q.device, case.q.dtype, case.q.dtype, True, M3_SHAPE)
    assert fp8_kv_kernels.steps(batch_name).bind_attention is sparse_attn.bind_attention
    selected = case.reference_selection()
    ops.sparse_attention(case.q, fp8, case.plan, selected, M3_SHAPE, case.scale, out=torch.empty_like(case.q))
    attention = [launch.params for launch in launches.launches if launch.kernel == "SparseAttentionKernel"]
    assert attention and all(params.fp8_kv for params in attention)


def test_the_prefill_attention_takes_every_token_in_tiles_of_consecutive_tokens(launches):
    """One launch over every token: each request's tokens in tiles of at most 64 / m (4 for MiniMax-M3), with a union
    bound no tile reaches (a tile's union has at most `candidates` blocks)."""
    case = launch_case("prefill")
    selected = case.reference_selection()
    out = torch.empty_like(case.q)
    sparse_attn_prefill.prefill_sparse_attention(case.q, case.kv_cache, case.batch, selected, M3_SHAPE, case.scale, out)
    assert launches.kernels() == ["PrefillAttentionKernel"]
    [launch] = launches.launches
    assert launch.args[-2] == launch.params.candidates == 4 * M3_SHAPE.topk_blocks
    request, first, end = launch.args[-5].cpu().unbind(1)  # the tiles
    assert launch.params.tokens_per_tile == 4 and int((end - first).max()) == 4
    assert (end - first).sum() == case.batch.num_tokens and (first[1:] == end[:-1]).all()
    assert (request.diff() >= 0).all() and request.unique().numel() == case.batch.num_requests


def test_the_decode_variants_take_what_they_are_passed(launches):
    """16 index-key elements a lane for a single token, 8 for more; top-k rows of a warp and of 1024 threads."""
    case = launch_case("decode")
    one = case.batch.token_chunks(1)[0][1]  # the first decode token alone
    for batch in (case.batch, one):
        scores = index_scores.index_block_scores(
            case.index_q[: batch.num_tokens], case.index_key_cache, batch, M3_SHAPE
        )
        for threads in (32, 1024):
            topk_blocks.topk_blocks(scores, batch.positions, M3_SHAPE, threads=threads)
    assert launches.kernels() == ["IndexScoreKernel", "TopkBlocksKernel", "TopkBlocksKernel"] * 2
    lanes = [launch.params.lane_elems for launch in launches.launches if launch.kernel == "IndexScoreKernel"]
    assert lanes == [8, 16] and case.batch.num_tokens > 1


def test_index_key_writes_take_what_they_are_passed(launches):
    from msa_kernels import ops

    case = launch_case("prefill")
    slots = torch.arange(case.index_q.shape[0], dtype=torch.int32)  # vLLM's slot mapping is int64; the launcher widens
    for cache in (case.index_key_cache, fp8_pages(case.index_key_cache)):
        ops.write_index_keys(cache, slots, case.index_q[:, :1], M3_SHAPE)
    assert launches.kernels() == ["IndexKeyWriteKernel"] * 2
    assert [launch.params.fp8 for launch in launches.launches] == [False, True]


def test_the_signature_check_refuses_what_a_compiled_kernel_would():
    """The stand-in fails where the GPU would: swapped, missing, misaligned and mistyped arguments, and a tensor
    where the kernel takes None (as the bf16 prefill index kernel does for the FP8 scales)."""
    kernel = SignatureCheck()(CombineKernel, CombineParams(8, 32, 2))
    partial, lse, out = torch.zeros(2, 3, 8, 32), torch.zeros(2, 3, 8), torch.zeros(3, 8, 32, dtype=torch.bfloat16)
    kernel(partial, lse, out)
    misaligned = torch.zeros(2 * 3 * 8 * 32 + 1)[1:].view(2, 3, 8, 32)
    for args, error in [
        ((lse, partial, out), "argument 0: rank 4"),
        ((partial, lse), "2 arguments, the kernel takes 3"),
        ((misaligned, lse, out), "argument 0: base not 16-byte aligned"),
        ((partial, lse, out.float()), "argument 2: torch.bfloat16 expected"),
    ]:
        with pytest.raises(AssertionError, match=error):
            kernel(*args)
    with pytest.raises(AssertionError, match="PrefillIndexScoreKernel argument 1: None expected, got Tensor"):
        check_arguments("PrefillIndexScoreKernel", [row_major(cutlass.Float32, 1), None], (lse[0, 0], lse[0]))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Decode, prefill and mixed batches: both index-score kernels serve any batch (ops gives each part its phase's kernel).
CASES = {
    "decode_ragged": ([1, 1, 1, 1], [1, 129, 4000, 8191]),
    "decode_long": ([1, 1], [131072, 70001]),
    "prefill_chunk": ([300, 1], [300, 1000]),
    "chunked_prefill": ([200], [5000]),
    "prefill_tile_edges": ([64, 65, 63, 1], [64, 1000, 63, 7]),
    "prefill_long_context": ([130], [70001]),
}


def index_score_shape(hi: int, hki: int, dp: int) -> MSAShape:
    """The index-score tests' layer: Hi index heads over Hki index-key heads of Dp, top-16."""
    return MSAShape(
        num_q_heads=hi * 2,
        num_kv_heads=1,
        head_dim=64,
        num_index_heads=hi,
        num_index_key_heads=hki,
        index_head_dim=dp,
        topk_blocks=16,
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("hi, hki, dp", INDEX_SCORE_PARAMS)
@pytest.mark.parametrize(
    "phase, lane_elems", [("decode", 8), ("decode", 16), ("prefill", None)], ids=["decode", "decode_16", "prefill"]
)
def test_index_score_kernel_matches_reference(case_name, hi, hki, dp, phase, lane_elems, monkeypatch):
    """decode_16: the decode kernel with 16 key elements a lane (IndexScoreParams.lane_elems)."""
    shape = index_score_shape(hi, hki, dp)
    q_lens, seq_lens = CASES[case_name]
    case = make_case(shape, q_lens, seq_lens, dtype=torch.bfloat16, device="cuda", seed=hi * 100 + dp)
    if phase == "decode":  # 16 elements a lane serve a single token: here every batch, to cover both
        monkeypatch.setattr(index_scores, "lane_elems_for", lambda num_tokens: lane_elems)
        launch = index_scores.index_block_scores
    else:
        launch = index_scores_prefill.prefill_index_block_scores
    got = launch(case.index_q, case.index_key_cache, case.batch, shape)
    want = reference.index_block_scores(case.index_q.float(), case.index_key_cache.float(), case.batch, shape)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got[~finite] == float("-inf")).all()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-3)
    # same top-k selection except at exact ties (the kernel's fp32 sums may tie or split differently)
    positions = case.batch.positions
    assert torch.equal(reference.topk_blocks(got, positions, shape), reference.topk_blocks(want, positions, shape))
    if phase == "prefill":  # as select_blocks runs it: hidden blocks unwritten, which top-k must not read
        workspace = Workspace(case.index_q.device)
        workspace.block_scores(tuple(got.shape)).fill_(float("nan"))  # whatever the memory held
        unfilled = index_scores_prefill.bind_block_scores(case.batch, shape, workspace)(
            case.index_q, case.index_key_cache
        )
        assert torch.equal(unfilled[finite], got[finite])
        selected = topk_blocks.topk_blocks(unfilled, positions, shape, phase="prefill")
        assert torch.equal(selected, topk_blocks.topk_blocks(got, positions, shape, phase="prefill"))


def fp8_pages(index_key_cache: torch.Tensor, page_padding: int = 16) -> Fp8IndexKeyCache:
    """index_key_cache [pages, B, Hki, Dp] quantised by the reference into FP8 pages as vLLM binds them (one uint8
    row per page, values then scales), each page followed by page_padding unused bytes (a page stride larger
    than the page, which the kernels must follow)."""
    num_pages, block_size, hki, dp = index_key_cache.shape
    size = page_bytes(block_size, hki, dp)
    raw = torch.zeros(num_pages, size + page_padding, dtype=torch.uint8, device=index_key_cache.device)
    cache = Fp8IndexKeyCache.from_pages(raw[:, :size], block_size, hki, dp)
    values, scales = quantize_rows(index_key_cache)
    cache.values.copy_(values)
    cache.scales.copy_(scales)
    return cache


def exact_fp8_operands(index_q: torch.Tensor, cache: Fp8IndexKeyCache) -> tuple[torch.Tensor, torch.Tensor]:
    """What the FP8 kernels multiply, in float64: the index queries rounded to e4m3 as quantize_rows rounds them,
    and the FP8 cache's keys, each times its scale."""
    q8, q_scales = quantize_rows(index_q)
    return q8.double() * q_scales.double()[..., None], cache.values.double() * cache.scales.double()[..., None]


def assert_selects_as(got_scores, want_scores, positions, shape, tol):
    """got_scores' top-k blocks are want_scores', except in rows where want_scores' k-th and (k+1)-th best
    ranked blocks are within tol (float32 summation order may swap those)."""
    got = reference.topk_blocks(got_scores, positions, shape)
    want = reference.topk_blocks(want_scores, positions, shape)
    k, max_blocks = shape.topk_blocks, want_scores.shape[-1]
    differ = (got != want).any(-1)
    if max_blocks <= k:
        assert not differ.any()
        return
    block = torch.arange(max_blocks, device=want_scores.device)[None, None, :]
    query_block = (positions // shape.block_size).long()[:, None, None]
    forced = (block <= query_block) & ((block > query_block - shape.local_blocks) | (block < shape.init_blocks))
    top = want_scores.double().masked_fill(forced, float("inf")).topk(k + 1, dim=-1).values
    near_tie = (top[..., k - 1] - top[..., k]).abs() <= tol  # inf - inf (nan): no tie
    assert not (differ & ~near_tie).any(), differ.nonzero()[:8].tolist()


# Decode batches, FP8 index keys: contexts off the 128 grid, 136K, fewer blocks than k, a verification batch.
FP8_DECODE_CASES = {
    "decode_ragged": ([1, 1, 1, 1], [1, 129, 4000, 8191]),
    "decode_long": ([1, 1], [131072 + 5000, 70001]),
    "decode_fewer_blocks_than_k": ([1, 1, 1], [5, 300, 1500]),
    "verification": ([4, 4, 4], [131, 2000, 9000]),
}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case_name", FP8_DECODE_CASES)
@pytest.mark.parametrize("hi, hki, dp", INDEX_SCORE_PARAMS)
def test_fp8_index_score_kernel_matches_the_reference(case_name, hi, hki, dp):
    """The decode kernel on FP8 pages (NaN in every slot no request owns, pages strided) against the reference's
    function in float64: the same e4m3 queries and keys (both round as quantize_rows does), so only the
    kernel's float32 sums differ, far below an e4m3 step of one query element (a rounding difference)."""
    shape = index_score_shape(hi, hki, dp)
    q_lens, seq_lens = FP8_DECODE_CASES[case_name]
    case = make_case(shape, q_lens, seq_lens, dtype=torch.bfloat16, device="cuda", seed=hi * 100 + dp + 1)
    cache = fp8_pages(case.index_key_cache)
    got = index_scores_fp8.fp8_index_block_scores(case.index_q, cache, case.batch, shape)
    exact_q, exact_keys = exact_fp8_operands(case.index_q, cache)
    want = reference.index_block_scores(exact_q, exact_keys, case.batch, shape)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got[~finite] == float("-inf")).all()
    # float32 summation order: ~1e-5 here; one query element an e4m3 step off would move a score by ~1e-1
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-4, atol=1e-3)
    # the reference on the GPU (float32, the queries rounded by quantize_rows there) agrees as closely
    reference_scores = reference.index_block_scores(case.index_q, cache, case.batch, shape)
    torch.testing.assert_close(got[finite], reference_scores[finite], rtol=1e-4, atol=1e-3)
    assert_selects_as(got, want, case.batch.positions, shape, tol=1e-3)


# Prefill parts, FP8 index keys: tile edges, a chunk after a long context, fewer blocks than k.
FP8_PREFILL_CASES = {
    "prefill_chunk": ([300, 70], [300, 1000]),
    "chunked_prefill": ([200], [5000]),
    "prefill_tile_edges": ([64, 65, 63, 1], [64, 1000, 63, 7]),
    "prefill_long_context": ([130], [70001]),
    "prefill_fewer_blocks_than_k": ([100, 40], [300, 40]),
}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case_name", FP8_PREFILL_CASES)
@pytest.mark.parametrize("hi, hki, dp", INDEX_SCORE_PARAMS)
def test_fp8_prefill_index_score_kernel_matches_the_reference(case_name, hi, hki, dp):
    """The prefill kernel's FP8 variant (e4m3 warpgroup MMAs on strided FP8 pages, NaN in every slot no request
    owns) against the reference's function in float64 on the same e4m3 queries and keys. Hopper's FP8 MMAs do
    not keep float32's precision while they accumulate (about 13 significant bits, inside each 32-element K
    step, up to 31 truncated partial sums, and on its running total), so the bound is (16 + Dp/32) x 2^-13 of
    the score's product magnitudes (sum_i |q_i k_i|, max-pooled as the scores are), plus float32's slack: a
    CPU model of that truncation on these inputs used at most a third of it, a wrong key scale or column
    would use many times it. The test prints how much of it the largest error used."""
    shape = index_score_shape(hi, hki, dp)
    q_lens, seq_lens = FP8_PREFILL_CASES[case_name]
    case = make_case(shape, q_lens, seq_lens, dtype=torch.bfloat16, device="cuda", seed=hi * 100 + dp + 2)
    cache = fp8_pages(case.index_key_cache)
    got = index_scores_prefill.prefill_index_block_scores(case.index_q, cache, case.batch, shape)
    exact_q, exact_keys = exact_fp8_operands(case.index_q, cache)
    want = reference.index_block_scores(exact_q, exact_keys, case.batch, shape)
    magnitudes = reference.index_block_scores(exact_q.abs(), exact_keys.abs(), case.batch, shape)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got[~finite] == float("-inf")).all()
    bound = 1e-3 + 1e-4 * want[finite].abs() + (16 + dp // 32) * 2**-13 * magnitudes[finite]
    error = (got[finite].double() - want[finite]).abs()
    print(f"\n{case_name} Hi {hi} Hki {hki} Dp {dp}: largest error {(error / bound).max().item():.2f} of the bound")
    assert (error <= bound).all(), (error / bound).max().item()
    assert_selects_as(got, want, case.batch.positions, shape, tol=bound.max().item())


def random_index_keys(tokens: int, hki: int, dp: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 index keys [tokens, Hki, Dp] with the rows quantisation must get right: magnitudes from 1e-7 (below
    the amax floor) to 1e4, a zero row, an outlier that sends its row's other elements to e4m3 subnormals, and
    exact e4m3 rounding ties (amax 448: scale 1, x / scale = x) that must round to even."""
    magnitudes = torch.logspace(-7, 4, tokens * hki, device="cuda")
    magnitudes = magnitudes[torch.randperm(tokens * hki, device="cuda", generator=generator)]
    keys = torch.randn(tokens * hki, dp, device="cuda", generator=generator) * magnitudes[:, None]
    keys[0] = 0
    keys[1, 3] = 1000 * keys[1].abs().max()
    ties = torch.tensor(
        [1.0625, 1.1875, -1.0625, 3.375, 0.0068359375, 448.0], device="cuda"
    )  # ties (7/1024: subnormal)
    keys[2] = ties.repeat(-(-dp // len(ties)))[:dp]
    keys[2, -1] = 448.0
    return keys.to(torch.bfloat16).view(tokens, hki, dp)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("hki, dp, fp8", INDEX_KEY_WRITE_PARAMS)
def test_index_key_write_kernel_stores_the_references_bytes_also_replayed_from_a_cuda_graph(hki, dp, fp8):
    """Every byte of the pages equals the reference's (an FP8 cache: quantize_rows on the GPU and on the CPU, the
    same IEEE float32 operations, so no ulp is allowed): the rows (FP8: values and scales) at the slots, padding
    slots (-1) and rows past len(slot_mapping) skipped, the rest of the pages untouched. Then the same write
    captured in a CUDA graph, replayed on new keys and slots."""
    block_size, num_pages, tokens = 128, 6, 40
    generator = torch.Generator(device="cuda").manual_seed(hki * 1000 + dp + fp8)
    row_bytes = page_bytes(block_size, hki, dp) if fp8 else block_size * hki * dp * 2
    raw = torch.randint(0, 256, (num_pages, row_bytes + 16), dtype=torch.uint8, device="cuda")
    want_raw = raw.clone()

    def cache_of(pages):
        if fp8:
            return Fp8IndexKeyCache.from_pages(pages[:, :row_bytes], block_size, hki, dp)
        return pages[:, :row_bytes].view(torch.bfloat16).view(num_pages, block_size, hki, dp)

    def random_slots():
        slots = torch.randperm(num_pages * block_size, device="cuda", generator=generator)[:tokens]
        return slots.masked_fill(torch.rand(tokens, device="cuda", generator=generator) < 0.2, -1)

    keys = random_index_keys(tokens + 3, hki, dp, generator)  # 3 rows past the slots: not written
    slots = random_slots()
    index_key_write.write_index_keys(cache_of(raw), slots, keys)
    reference.write_index_keys(cache_of(want_raw), slots, keys)
    torch.cuda.synchronize()
    assert torch.equal(raw, want_raw)
    on_cpu = raw.cpu().clone()
    reference.write_index_keys(cache_of(on_cpu), slots.cpu(), keys.cpu())
    assert torch.equal(raw.cpu(), on_cpu)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_key_write.write_index_keys(cache_of(raw), slots, keys)
    keys.copy_(random_index_keys(tokens + 3, hki, dp, generator))
    slots.copy_(random_slots())
    graph.replay()
    reference.write_index_keys(cache_of(want_raw), slots, keys)
    torch.cuda.synchronize()
    assert torch.equal(raw, want_raw)


PAGE_WORDS = [4, 4096 + 4, 128 * 4 * 256 // 2]  # a 16-byte page, one past a CTA's chunk, an M3 page (bf16)


@pytest.mark.parametrize("page_words", PAGE_WORDS)
def test_page_copy_kernel_compiles_for_sm90a(page_words, sm90a):
    compiles_and_caches(PageCopyKernel, PageCopyParams(page_words), sm90a)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_words", PAGE_WORDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_page_copy_kernel_copies_the_missed_pages_from_pinned_host_memory_also_replayed_from_a_cuda_graph(
    page_words, dtype
):
    """Host pages in pinned memory, read through their device view (UVA, as the host tier serves them): the pages
    listed copied byte for byte, padding entries (-1) and the other device pages untouched; then the copy captured
    in a CUDA graph, replayed on a new list."""
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    host_count, device_count, entries = 40, 12, 10
    page_bytes = page_words * 4
    generator = torch.Generator().manual_seed(page_words)
    host = torch.randint(0, 256, (host_count, page_bytes), dtype=torch.uint8, generator=generator).view(dtype)
    host = host.pin_memory()
    host_view = get_accelerator_view_from_cpu_tensor(host)
    device = torch.randint(0, 256, (device_count, page_bytes), dtype=torch.uint8, device="cuda").view(dtype)

    def random_list():
        copy_from = torch.randperm(host_count, generator=generator)[:entries].int()
        copy_to = torch.randperm(device_count, generator=generator)[:entries].int()
        padding = torch.rand(entries, generator=generator) < 0.3
        return copy_from.masked_fill(padding, -1).cuda(), copy_to.masked_fill(padding, -1).cuda()

    def check(copy_from, copy_to, before):
        want = before.clone()
        for source, target in zip(copy_from.tolist(), copy_to.tolist()):
            if source >= 0:
                want[target] = host[source].view(torch.uint8)
        assert torch.equal(device.view(torch.uint8).cpu(), want)

    copy_from, copy_to = random_list()
    before = device.view(torch.uint8).cpu()
    page_copy.copy_pages(host_view, device, copy_from, copy_to)
    torch.cuda.synchronize()
    check(copy_from, copy_to, before)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        page_copy.copy_pages(host_view, device, copy_from, copy_to)
    new_from, new_to = random_list()
    copy_from.copy_(new_from)
    copy_to.copy_(new_to)
    before = device.view(torch.uint8).cpu()
    graph.replay()
    torch.cuda.synchronize()
    check(copy_from, copy_to, before)


@pytest.mark.parametrize("entries, num_slots", [(1024, 1024), (4096, 3000), (8192, 65536)])
def test_page_resolve_kernel_compiles_for_sm90a(entries, num_slots, sm90a):
    compiles_and_caches(PageResolveKernel, PageResolveParams(entries, num_slots), sm90a)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "requests, heads, topk, num_slots",
    [(1, 4, 16, 64), (5, 2, 3, 40), (32, 4, 16, 2048)],
    ids=["m3-1", "small", "m3-32"],
)
def test_page_resolve_kernel_keeps_the_reference_cache_and_copies_step_after_step_also_replayed_from_a_cuda_graph(
    requests, heads, topk, num_slots
):
    """A host tier's decode steps resolved by the kernel and by the torch ops (msa_kernels.host_tier.resolve_step)
    side by side from the same empty cache: selections that keep most blocks from step to step and take new ones
    (hits, misses, evictions, the clock hand wrapping), rows with fewer blocks than K (-1), two requests sharing
    prefix pages; after every step the same cache (held, reference bits, slot of each host page, hand), copy list,
    counts, and the same device page for every block read. Then one step captured in a CUDA graph, replayed on new
    selections."""
    from msa_kernels import host_tier

    generator = torch.Generator().manual_seed(requests * 1000 + num_slots)
    max_blocks, host_pages = 64, requests * 64 + 8
    table = torch.randperm(host_pages, generator=generator)[: requests * max_blocks].view(requests, max_blocks)
    if requests > 1:
        table[1, :8] = table[0, :8]  # a shared prefix: one host page, two requests
    table = table.to(torch.int32).cuda()
    caches = {
        name: host_tier.PageCache.empty(num_slots, host_pages, "cuda", first_page=7) for name in ("kernel", "ref")
    }
    tables = {name: torch.full_like(table, -1) for name in caches}
    resolvers = {"kernel": page_resolve.resolve_step, "ref": host_tier.resolve_step}

    def selection(step):
        hot = torch.randint(0, 12, (requests, heads, topk), generator=generator)  # blocks most steps read
        cold = torch.randint(0, max_blocks, (requests, heads, topk), generator=generator)
        chosen = torch.where(torch.rand(requests, heads, topk, generator=generator) < 0.3 + 0.05 * step, cold, hot)
        chosen[torch.rand(requests, heads, topk, generator=generator) < 0.15] = -1
        return chosen.to(torch.int32).cuda()

    def check(selected, results):
        kernel, ref = caches["kernel"], caches["ref"]
        for field in ("held", "referenced", "slot_of", "hand"):
            assert torch.equal(getattr(kernel, field), getattr(ref, field)), field
        for got, want in zip(results["kernel"], results["ref"]):
            assert torch.equal(got, want)
        read = selected.flatten(1)
        rows = torch.arange(requests, device="cuda")[:, None].expand_as(read)
        mask = read >= 0
        assert torch.equal(tables["kernel"][rows[mask], read[mask]], tables["ref"][rows[mask], read[mask]])

    for step in range(12):
        selected = selection(step)
        results = {name: resolvers[name](caches[name], selected, table, tables[name]) for name in caches}
        torch.cuda.synchronize()
        check(selected, results)

    selected = selection(12)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the launch; the cache moves at the replay
        captured = page_resolve.resolve_step(caches["kernel"], selected, table, tables["kernel"])
    selected.copy_(selection(13))
    graph.replay()
    want = host_tier.resolve_step(caches["ref"], selected, table, tables["ref"])
    torch.cuda.synchronize()
    check(selected, {"kernel": captured, "ref": want})


@pytest.mark.parametrize("topk, block_size", [(16, 128), (8, 64)])
def test_selection_stats_kernel_compiles_for_sm90a(topk, block_size, sm90a):
    compiles_and_caches(SelectionStatsKernel, SelectionStatsParams(topk, block_size), sm90a)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens, decode_tokens, padding",
    [(32, 32, 0), (32, 24, 5), (40, 8, 0), (3000, 0, 0)],
    ids=["decode", "decode-padded", "mixed", "prefill"],
)
def test_selection_stats_kernel_adds_what_the_reference_adds_also_replayed_from_a_cuda_graph(
    num_tokens, decode_tokens, padding
):
    """M3's selection shape (Hi 4, K 16, 128-token blocks): the kernel's totals against the PyTorch path's, added
    twice eagerly, then captured in a CUDA graph and replayed on a new selection (the integer counts exact, the
    read-fraction sum to rounding: the kernel adds in another order)."""
    from msa_kernels.selection_stats import SELECTION_FIELDS, add_selection_stats
    from tests.test_reference import random_selection

    generator = torch.Generator().manual_seed(num_tokens + padding)
    selected, positions = random_selection(num_tokens, 4, 16, 128, generator, padding=padding)
    selected, positions = selected.cuda(), positions.cuda()
    fields = len(SELECTION_FIELDS)
    fraction_sum = SELECTION_FIELDS.index("read_fraction_sum")
    args = (128, decode_tokens, 57)  # block size, decode tokens, layers

    def check(totals, want):
        exact = [i for i in range(fields) if i != fraction_sum]
        assert torch.equal(totals[exact].cpu(), want[exact].cpu())
        assert torch.isclose(totals[fraction_sum], want[fraction_sum], rtol=1e-12)

    totals, want = (torch.zeros(fields, dtype=torch.float64, device="cuda") for _ in range(2))
    for _ in range(2):
        selection_stats.add_selection_stats(totals, selected, positions, *args)
        add_selection_stats(want, selected, positions, *args)
    check(totals, want)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selection_stats.add_selection_stats(totals, selected, positions, *args)
    new_selected, new_positions = random_selection(num_tokens, 4, 16, 128, generator, padding=padding)
    selected.copy_(new_selected)
    positions.copy_(new_positions)
    graph.replay()
    add_selection_stats(want, selected, positions, *args)
    torch.cuda.synchronize()
    check(totals, want)


# Positions: padding (-1), the first block, fewer blocks than k, block edges, off the 128 grid, 136K
# context (1063 blocks), and a 300-token prefill run.
TOPK_POSITIONS = [-1, 0, 5, 127, 128, 129, 1000, 2047, 2048, 4095, 70000, 131071, 135999, *range(3000, 3300)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("k, local, init", TOPK_PARAMS)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("row_threads", [32, 128, 256, 1024])
def test_topk_kernel_matches_reference(k, local, init, ties, row_threads):
    """Fresh random scores per case; with ties, scores take 4 values (zeros of either sign), so the lower block
    must win. Rows run on a warp each (4 rows a CTA, so Hi 5 leaves the last CTA a warp without a row), or a
    CTA of 128, 256 or 1024."""
    shape = MSAShape(
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        num_index_heads=4,
        num_index_key_heads=1,
        index_head_dim=64,
        topk_blocks=k,
        local_blocks=local,
        init_blocks=init,
    )
    if row_threads == 32:
        shape = replace(shape, num_q_heads=10, num_kv_heads=5, num_index_heads=5)
    positions = torch.tensor(TOPK_POSITIONS, dtype=torch.int32, device="cuda")  # as PagedBatch.positions
    max_blocks = 1100
    generator = torch.Generator(device="cuda").manual_seed(k * 100 + local * 10 + init + ties)
    size = (len(TOPK_POSITIONS), shape.num_index_heads, max_blocks)
    if ties:
        scores = torch.randint(-2, 2, size, device="cuda", generator=generator).float()
        coin = torch.rand(size, device="cuda", generator=generator) < 0.5
        scores = scores.masked_fill((scores == 0) & coin, -0.0)  # -0.0 ties +0.0
    else:
        scores = torch.randn(size, device="cuda", generator=generator) * 100
    blocks = torch.arange(max_blocks, device="cuda")
    scores = scores.masked_fill(blocks > (positions // 128)[:, None, None], float("-inf"))  # as the index-score kernels
    poison = torch.full(size[:2] + (k,), 7777, dtype=torch.int32, device="cuda")
    del poison  # the kernel's output reuses this memory: every slot must be written
    got = topk_blocks.topk_blocks(scores, positions, shape, threads=row_threads)
    want = reference.topk_blocks(scores, positions, shape)
    assert torch.equal(got, want)
    # out=: the rows of a larger selection (a step's decode or prefill part), nothing outside them
    step = torch.full((size[0] + 2, size[1], k), 7777, dtype=torch.int32, device="cuda")
    selected = topk_blocks.topk_blocks(scores, positions, shape, out=step[1:-1], threads=row_threads)
    assert selected.data_ptr() == step[1:-1].data_ptr()
    assert torch.equal(step[1:-1], want) and (step[[0, -1]] == 7777).all()


ATTENTION_CASES = {
    # decode: few tokens, so the blocks are split across CTAs and merged by the combine kernel
    "decode_ragged": ([1, 1, 1, 1, 1], [1, 129, 1000, 4000, 8191]),
    "decode_long": ([1, 1], [131072, 70001]),
    "decode_fewer_blocks_than_k": ([1, 1, 1], [5, 300, 1500]),
    # prefill / chunked prefill / mixed: the prefill kernel's tiles cut at request ends (77, 301
    # tokens), chunks that start inside a block
    "prefill_ragged": ([301, 77, 1], [301, 1000, 2049]),
    "chunked_prefill": ([256], [6000]),
    "chunked_prefill_long": ([700, 3], [70001, 5000]),
}


def attention_case(case_name: str, hq: int, hkv: int, hi: int, d: int):
    """(shape, bf16 case on the GPU) of one of ATTENTION_CASES with these head counts, 16 blocks selected."""
    shape = MSAShape(
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        num_index_heads=hi,
        num_index_key_heads=1,
        index_head_dim=64,
        topk_blocks=16,
    )
    q_lens, seq_lens = ATTENTION_CASES[case_name]
    return shape, make_case(shape, q_lens, seq_lens, dtype=torch.bfloat16, device="cuda", seed=hq + d + len(case_name))


def assert_close_to_float64(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 kernel output against the float64 reference: finite, cosine >= 0.999, relative error <= 1e-2."""
    assert torch.isfinite(got).all()
    cos = torch.nn.functional.cosine_similarity(got.double().flatten(), want.flatten(), dim=0)
    rel = (got.double() - want).norm() / want.norm()
    assert cos >= 0.999 and rel <= 1e-2, (cos.item(), rel.item())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case_name", ATTENTION_CASES)
@pytest.mark.parametrize("hq, hkv, hi, d", ATTENTION_PARAMS)
@pytest.mark.parametrize("kernel", ["per_token", "prefill"])
def test_sparse_attention_kernel_matches_reference(case_name, hq, hkv, hi, d, kernel):
    """per_token: sparse_attn.py (split-K for decode tokens); prefill: sparse_attn_prefill.py (every tile)."""
    if kernel == "prefill" and (hq, hkv, hi, d) not in PREFILL_PARAMS:
        pytest.skip("the prefill kernel does not serve this shape")
    shape, case = attention_case(case_name, hq, hkv, hi, d)
    selected = case.reference_selection()
    out = torch.full_like(case.q, float("nan"))
    attend = {"per_token": sparse_attn.sparse_attention, "prefill": sparse_attn_prefill.prefill_sparse_attention}
    got = attend[kernel](case.q, case.kv_cache, case.batch, selected, shape, case.scale, out=out)
    want = reference.sparse_attention(case.q.double(), case.kv_cache.double(), case.batch, selected, shape, case.scale)
    assert_close_to_float64(got, want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case_name", ATTENTION_CASES)
@pytest.mark.parametrize("hq, hkv, hi, d", ATTENTION_PARAMS)
def test_sparse_attention_kernel_reads_an_fp8_kv_cache(case_name, hq, hkv, hi, d):
    """e4m3 pages with per-tensor scales (NaN bytes in unowned slots), through ops as a served layer's decode and
    prefill parts call it, against the reference's e4m3 x scale in float64."""
    from msa_kernels import ops

    shape, case = attention_case(case_name, hq, hkv, hi, d)
    kv_scales = (0.37, 1.9)
    fp8 = reference.fp8_kv_cache(case.kv_cache, kv_scales)
    fp8_kv_kernels = ops.kernels(case.q.device, case.q.dtype, case.q.dtype, True, shape)
    assert fp8_kv_kernels.decode.bind_attention is fp8_kv_kernels.prefill.bind_attention is sparse_attn.bind_attention
    selected = case.reference_selection()
    out = torch.full_like(case.q, float("nan"))
    got = ops.sparse_attention(case.q, fp8, case.plan, selected, shape, case.scale, out=out, kv_scales=kv_scales)
    want = reference.sparse_attention(
        case.q.double(), fp8, case.batch, selected, shape, case.scale, kv_scales=kv_scales
    )
    assert got.data_ptr() == out.data_ptr()
    assert_close_to_float64(got, want)


@gpu
@pytest.mark.gpu
def test_ops_dispatch_runs_the_cute_index_kernel_and_matches_the_reference():
    from msa_kernels import ops

    shape = M3_SHAPE
    case = make_case(shape, [1, 1, 77], [9000, 300, 2100], dtype=torch.bfloat16, device="cuda", seed=7)
    for phase in ("decode", "prefill"):
        assert ops.uses_cute_index_scores(case.index_q, shape, phase)
        assert ops.uses_cute_sparse_attention(case.q, shape, phase)
    assert ops.describe(case.q.device, case.q.dtype, shape) == (
        "index scores: CuTeDSL, top-k: CuTeDSL, sparse attention: CuTeDSL, index-key writes: CuTeDSL"
    )
    check = case.layer_against_reference()
    assert check.selection_equal and check.cosine >= 0.99 and check.rel_err <= 1e-2, check[:3]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("index_keys", ["bf16", "fp8"])
@pytest.mark.parametrize("query_len", [1, 4], ids=["decode", "verification"])
def test_msa_layer_replayed_from_a_cuda_graph_on_a_padded_batch_matches_the_reference(query_len, index_keys):
    """What vLLM's full decode graphs do: capture the layer on persistent batch buffers once, then
    replay it after writing a smaller batch into them (padding requests: seq_len 0, no tokens). Each
    request brings query_len tokens: one, or under speculative decoding 1 + 3 drafted tokens, which
    vLLM's builder counts as decodes too (uniform verification batches replay full graphs).

    The graph also writes the step's index keys (ops.write_index_keys, as the backend does; padding slots -1) into
    slots poisoned before the replay; fp8: FP8 index-key pages."""
    from msa_kernels import ops
    from msa_kernels.plan import StepPlan
    from msa_kernels.shapes import PagedBatch

    shape = M3_SHAPE
    seq_lens = [20000, 130, 7, 4500, 131072 - 3]
    n, padded = len(seq_lens), 8
    case = make_case(shape, [query_len] * n, seq_lens, dtype=torch.bfloat16, device="cuda", seed=11)
    fp8 = index_keys == "fp8"
    index_key_cache = fp8_pages(case.index_key_cache) if fp8 else case.index_key_cache
    assert ops.graph_capturable(case.q.device, case.q.dtype, shape, index_key_dtype=index_key_cache.dtype)
    starts = list(range(0, (padded + 1) * query_len, query_len))  # capture: 8 copies of request 0
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    lens = torch.full((padded,), seq_lens[0], dtype=torch.int32, device="cuda")
    table = case.batch.block_table[:1].repeat(padded, 1).contiguous()
    q = torch.randn(padded * query_len, *case.q.shape[1:], device="cuda", dtype=torch.bfloat16)
    index_q = torch.randn(padded * query_len, *case.index_q.shape[1:], device="cuda", dtype=torch.bfloat16)
    # the step's index keys and their slots: the capture writes no slot
    step_keys = torch.randn(padded * query_len, *case.index_key_cache.shape[2:], device="cuda", dtype=torch.bfloat16)
    slot_mapping = torch.full((padded * query_len,), -1, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)

    def layer():
        # fresh: computed in the graph; the host's view of query_start_loc, as vLLM's builder gives it
        batch = PagedBatch(query_start_loc=qsl, seq_lens=lens, block_table=table, query_start_loc_cpu=starts)
        plan = StepPlan.of(batch, max_decode_query_len=query_len)  # every request a decode, as the builder plans it
        ops.write_index_keys(index_key_cache, slot_mapping, step_keys, shape)
        return ops.msa_attention(q, index_q, case.kv_cache, index_key_cache, plan, shape, case.scale, out=out)[1]

    layer()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selected = layer()
    tokens = n * query_len
    qsl[n + 1 :] = tokens
    lens.copy_(torch.tensor(seq_lens + [0] * (padded - n), dtype=torch.int32))
    table.zero_()
    table[:n] = case.batch.block_table
    q[:tokens], index_q[:tokens] = case.q, case.index_q
    out.fill_(float("nan"))
    # the query tokens' own index keys, written by the replay into poisoned slots
    positions = case.batch.positions.long()
    pages = case.batch.block_table[case.batch.token_requests.long(), positions // shape.block_size].long()
    in_page = positions % shape.block_size
    slot_mapping[:tokens] = pages * shape.block_size + in_page
    step_keys[:tokens] = case.index_key_cache[pages, in_page]
    planes = [index_key_cache.values.view(torch.uint8), index_key_cache.scales] if fp8 else [index_key_cache]
    want_planes = [plane.clone() for plane in planes]
    for plane in planes:
        plane[pages, in_page] = 0x7F if plane.dtype == torch.uint8 else float("nan")  # 0x7F: e4m3 NaN
    graph.replay()
    torch.cuda.synchronize()
    for plane, want_plane in zip(planes, want_planes):
        assert torch.equal(plane.view(torch.uint8), want_plane.view(torch.uint8))
    if fp8:
        # The graph's selection is the eager kernels' (deterministic), which is the reference's up to near-ties.
        got_scores = index_scores_fp8.fp8_index_block_scores(case.index_q, index_key_cache, case.batch, shape)
        reference_scores = reference.index_block_scores(case.index_q, index_key_cache, case.batch, shape)
        assert_selects_as(got_scores, reference_scores, case.batch.positions, shape, tol=1e-3)
        want_sel = reference.topk_blocks(got_scores, case.batch.positions, shape)
    else:
        want_sel = case.reference_selection()
    assert torch.equal(selected[:tokens], want_sel)
    assert (selected[tokens:] == -1).all()
    want = reference.sparse_attention(case.q.double(), case.kv_cache.double(), case.batch, want_sel, shape, case.scale)
    got = out[:tokens].double()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    rel = (got - want).norm() / want.norm()
    assert cos >= 0.999 and rel <= 1e-2, (cos.item(), rel.item())
    assert (out[tokens:] == 0).all()  # padding tokens read nothing and get zeros, never NaN
