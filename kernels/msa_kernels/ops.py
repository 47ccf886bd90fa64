"""The MSA entry points callers use, and the one place that picks an implementation for each step.

Data flow of one MSA layer (msa_attention) on a step's plan (msa_kernels.plan.StepPlan: the batch split once into
its decode and prefill parts, each with its workspace), once the paged caches hold the step's keys:

    per part:  index queries x paged index keys --index_block_scores--> block scores [T, Hi, blocks]
               --top-k--> selected blocks [T, Hi, K]  (the part's rows of the step's one selection)
               --sparse_attention--> output [T, Hq, D]  (the part's rows of the step's one output)

kernels() chooses, once per kind of layer (device, dtypes, K/V cache kind, shape), what runs every step: a CuTeDSL
kernel (kernels/msa_kernels/cute) where the input is on a Hopper GPU with CuTeDSL and the kernel's can_implement
accepts its dtype and shape, else the next kernel of the list, else the PyTorch reference
(kernels/msa_kernels/reference.py):

    step              decode part                          prefill part
    index scores      index_scores.py (bf16 keys),         index_scores_prefill.py (bf16 or FP8 keys),
                      index_scores_fp8.py (FP8 keys)       then as in decode
    top-k             topk_blocks.py (fp32 scores)         topk_blocks.py (fp32 scores)
    sparse attention  sparse_attn.py (split-K) +           sparse_attn_prefill.py (bf16 K/V), else
                      combine.py                           sparse_attn.py (an FP8 K/V cache)
                      (a K/V cache whose head dim is strided: the reference)
    index-key write   index_key_write.py: the step's index keys into bf16 pages, or quantised into FP8 pages

A mixed step runs as its two parts, into slices of one output. A step of one phase runs as it is. A decode part
never syncs the host and has no data-dependent shapes: a full-graph decode step (single-token or a uniform
verification batch) can be captured.

The index-key cache is written by write_index_keys, once per step and layer (on Hopper the CuTeDSL kernel, without
a host sync; elsewhere the reference). An FP8 index-key cache (msa_kernels.fp8_index_keys), whose keys that kernel
quantises on the device, is scored, in a decode part, by
index_scores_fp8.py reading the FP8 pages, in a prefill part by index_scores_prefill.py's FP8 variant (e4m3
warpgroup MMAs; where it does not serve the shape, the decode kernel; where neither does, the reference, and a
one-time warning says so). All compute the reference's function (the index queries rounded to e4m3 per token and
index head), so a token selects the same blocks in either phase up to the MMAs' summation (float32 in decode; the
FP8 warpgroup MMAs accumulate with less precision: msa_kernels/cute/index_scores_prefill.py). With the decode and
write kernels an FP8 decode step, like a bf16 one, can be captured in a full CUDA graph (graph_capturable).
"""

import functools
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from msa_kernels import reference
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache
from msa_kernels.plan import PlanPart, StepPlan, Workspace
from msa_kernels.shapes import MSAShape, PagedBatch, Phase

CUTE_DSL_REQUIREMENTS = {  # pyproject.toml's, by import name: CuTeDSL (vLLM 0.34's pin), its calling convention
    "cutlass": "nvidia-cutlass-dsl==4.8.0",
    "tvm_ffi": "apache-tvm-ffi>=0.1.11,<0.2",
}
logger = logging.getLogger("vllm.msa.kernels")  # under vllm's logger, so serving logs show it
SCORE_BYTES = 1 << 30  # largest block-score tensor select_blocks materialises at once (_score_chunks)


@functools.cache
def _cute_available(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    for module, requirement in CUTE_DSL_REQUIREMENTS.items():
        try:
            importlib.import_module(module)
        except ImportError as error:
            logger.warning(
                "FLASH_MSA: %s is not importable (%s), so the MSA steps run the PyTorch path on this Hopper GPU "
                "(same results, far slower): pip install '%s'",
                module,
                error,
                requirement,
            )
            return False
    return True


def _on_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and _cute_available(device.index or 0)


def unserved_reason(device: torch.device, dtype: torch.dtype, shape: MSAShape) -> str | None:
    """Why the CuTeDSL kernels leave steps of a layer of this shape and dtype to the PyTorch path on this CUDA device,
    for the start-up warning: not a Hopper GPU, else the shape or dtype. None where CuTeDSL is not importable on a
    Hopper GPU (_cute_available warned, naming the package)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the CuTeDSL kernels run on Hopper GPUs (compute capability 9.0), this GPU is {major}.{minor}"
    if not _on_hopper(device):
        return None
    return (
        f"the CuTeDSL kernels do not serve head_dim {shape.head_dim} / index_head_dim {shape.index_head_dim} with "
        f"{shape.block_size}-token blocks in {dtype}"
    )


class Steps(NamedTuple):
    """The implementations of one phase's part of a step. The bind_ ones take what the layers of a step share (the
    part's batch, its workspace) and return the launch a layer call makes, which the part's workspace keeps for the
    step (msa_kernels.plan.Workspace.launch):

    index_scores(index_q, index_key_cache, batch, shape): every visible block's score (index_block_scores);
    bind_scores(batch, shape, workspace) -> (index_q, index_key_cache) -> the scores as top-k needs them, in the
        workspace's (top-k reads each row's visible blocks only, so an implementation may leave the others as the
        memory held them; top-k consumes them before the next call);
    bind_topk(positions, max_blocks, shape) -> (scores, out) -> None: into out [T, Hi, K] int32;
    bind_attention(batch, shape, topk, fp8_kv, workspace) -> (q, kv_cache, selected, scale, out, kv_scales) -> the
        output (out where given), on a contiguous K/V cache of the chooser's kind (bf16 or FP8; one whose head dim is
        strided runs the reference)."""

    index_scores: Callable
    bind_scores: Callable
    bind_topk: Callable
    bind_attention: Callable


@dataclass(frozen=True, eq=False)  # compared and hashed as itself: a key of its bound launches
class Kernels:
    """What runs every step of a layer of one shape: the decode part's steps, the prefill part's, and what writes
    the step's index keys into the index-key cache (bf16 or FP8). Chosen once per kind of layer (kernels()); a layer
    holds its own (vllm_msa's MSAImpl), and the first layer call of a step binds them to the step's parts for the
    others, so a call looks nothing up and works nothing out again."""

    decode: Steps
    prefill: Steps
    index_key_writer: Callable
    shape: MSAShape

    def steps(self, phase: Phase) -> Steps:
        return self.decode if phase == "decode" else self.prefill

    def write_index_keys(
        self, index_key_cache: torch.Tensor | Fp8IndexKeyCache, slot_mapping: torch.Tensor, index_keys: torch.Tensor
    ) -> None:
        """Store per-token index keys [>= T, Hki, Dp] at the flat slots slot_mapping [T] (< 0: skipped), as
        reference.write_index_keys does, once (on Hopper the CuTeDSL kernel: no host sync, an FP8 cache's keys
        quantised on the device)."""
        self.index_key_writer(index_key_cache, slot_mapping, index_keys)

    def select_blocks(
        self,
        index_q: torch.Tensor,
        index_key_cache: torch.Tensor | Fp8IndexKeyCache,
        plan: StepPlan,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Index scores, then top-k: the selected blocks [T, Hi, K] int32 (the plan's batch: the index-key cache's
        block table), written into out if given (e.g. layer_selection)."""
        shape = self.shape
        selected = (
            out
            if out is not None
            else torch.empty(
                (plan.batch.num_tokens, shape.num_index_heads, shape.topk_blocks),
                dtype=torch.int32,
                device=index_q.device,
            )
        )
        for part in plan.parts:
            select = part.workspace.launch((self, "selection"), self._bind_selection, part)
            select(part.of(index_q), index_key_cache, part.of(selected))
        return selected

    def _bind_selection(self, part: PlanPart) -> Callable[..., None]:
        """select_blocks' launch on one part: its score chunks (_score_chunks) scored and selected in turn (the
        chunks share one block-score tensor, the first's the largest)."""
        steps = self.steps(part.phase)
        chunks = [
            (
                rows,
                steps.bind_scores(chunk, self.shape, part.workspace),
                steps.bind_topk(chunk.positions, chunk.block_table.shape[1], self.shape),
            )
            for rows, chunk in _score_chunks(part.batch, self.shape)
        ]

        def select(index_q: torch.Tensor, index_key_cache: torch.Tensor | Fp8IndexKeyCache, out: torch.Tensor) -> None:
            for rows, scores, topk in chunks:
                topk(scores(_rows(index_q, rows), index_key_cache), _rows(out, rows))

        return select

    def sparse_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: StepPlan,
        selected: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """Exact-softmax GQA attention over the selected blocks, [T, Hq, D] in q's dtype (into out if given), on a
        K/V cache of the kind these kernels were chosen for (bf16, or FP8 dequantised with kv_scales = (k_scale,
        v_scale)); the kernels read any view with the head dim innermost (vLLM's cache through reference.kv_planes),
        a K/V cache whose head dim is strided runs the reference."""
        shape = self.shape
        result = out if out is not None else q.new_empty((plan.batch.num_tokens, shape.num_q_heads, shape.head_dim))
        if kv_cache.stride(-1) != 1:
            return reference.sparse_attention(
                q, kv_cache, plan.batch, selected, shape, scale, out=result, kv_scales=kv_scales
            )
        for part in plan.parts:
            self.attend_part(part, q, kv_cache, selected, scale, result, kv_scales)
        return result

    def attend_part(
        self,
        part: PlanPart,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        selected: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        kv_scales: tuple[float, float],
    ) -> None:
        """sparse_attention of one part of a step (its rows of q, selected and out [step tokens, ...]) on a contiguous
        K/V cache: the host tier attends a step's parts on caches of their own (vllm_msa/host_tier.py)."""
        key = (self, "attention", selected.shape[-1], reference.is_fp8_kv(kv_cache))
        attend = part.workspace.launch(key, self._bind_attention, part, *key[2:])
        attend(part.of(q), kv_cache, part.of(selected), scale, part.of(out), kv_scales)

    def _bind_attention(self, part: PlanPart, topk: int, fp8_kv: bool) -> Callable[..., torch.Tensor]:
        return self.steps(part.phase).bind_attention(part.batch, self.shape, topk, fp8_kv, part.workspace)


@functools.cache
def kernels(
    device: torch.device, dtype: torch.dtype, index_key_dtype: torch.dtype, fp8_kv: bool, shape: MSAShape
) -> Kernels:
    """The one chooser: what runs each step of a layer of this shape, for inputs of this device and dtype, an
    index-key cache of index_key_dtype (Fp8IndexKeyCache.dtype: an FP8 cache) and a bf16 or FP8 (fp8_kv) K/V cache:
    chosen once per layer kind, since an eager layer call must cost microseconds of host time."""
    return Kernels(
        _steps(device, dtype, index_key_dtype, fp8_kv, shape, "decode"),
        _steps(device, dtype, index_key_dtype, fp8_kv, shape, "prefill"),
        _index_key_writer(device, dtype, index_key_dtype, shape),
        shape,
    )


def _bind_reference_scores(batch: PagedBatch, shape: MSAShape, workspace: Workspace) -> Callable:
    return lambda index_q, index_key_cache: reference.index_block_scores(index_q, index_key_cache, batch, shape)


def _bind_reference_topk(positions: torch.Tensor, max_blocks: int, shape: MSAShape) -> Callable:
    return lambda scores, out: reference.topk_blocks(scores, positions, shape, out=out)


def _bind_reference_attention(
    batch: PagedBatch, shape: MSAShape, topk: int, fp8_kv: bool, workspace: Workspace
) -> Callable:
    def attend(q, kv_cache, selected, scale, out, kv_scales):
        return reference.sparse_attention(q, kv_cache, batch, selected, shape, scale, out=out, kv_scales=kv_scales)

    return attend


def _steps(
    device: torch.device, dtype: torch.dtype, index_key_dtype: torch.dtype, fp8_kv: bool, shape: MSAShape, phase: Phase
) -> Steps:
    steps = Steps(reference.index_block_scores, _bind_reference_scores, _bind_reference_topk, _bind_reference_attention)
    if not _on_hopper(device):
        return steps
    from msa_kernels.cute import (
        index_scores,
        index_scores_fp8,
        index_scores_prefill,
        sparse_attn,
        sparse_attn_prefill,
        topk_blocks,
    )

    served = (dtype, index_key_dtype, shape.index_head_dim, shape.block_size)
    if phase == "prefill" and index_scores_prefill.PrefillIndexScoreKernel.can_implement(*served):
        steps = steps._replace(
            index_scores=index_scores_prefill.prefill_index_block_scores,
            bind_scores=index_scores_prefill.bind_block_scores,
        )
    elif index_scores.IndexScoreKernel.can_implement(*served):
        steps = steps._replace(index_scores=index_scores.index_block_scores, bind_scores=index_scores.bind_block_scores)
    elif index_scores_fp8.Fp8IndexScoreKernel.can_implement(*served):
        steps = steps._replace(
            index_scores=index_scores_fp8.fp8_index_block_scores, bind_scores=index_scores_fp8.bind_block_scores
        )
    elif index_key_dtype == Fp8IndexKeyCache.dtype:
        _warn_fp8_index_keys_run_the_reference()
    score_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # what either path returns
    if topk_blocks.TopkBlocksKernel.can_implement(score_dtype):
        steps = steps._replace(bind_topk=functools.partial(topk_blocks.bind_topk, phase=phase))
    heads = (shape.num_q_heads, shape.num_index_heads)
    if (
        not fp8_kv
        and phase == "prefill"
        and sparse_attn_prefill.PrefillAttentionKernel.can_implement(dtype, *heads, shape.head_dim, shape.block_size)
    ):
        bind_prefill = sparse_attn_prefill.bind_attention

        def bind_prefill_attention(batch, shape, topk, fp8_kv, workspace):
            attend = bind_prefill(batch, shape, topk, workspace)
            return lambda q, kv_cache, selected, scale, out, kv_scales: attend(q, kv_cache, selected, scale, out)

        steps = steps._replace(bind_attention=bind_prefill_attention)  # bf16 pages: no K/V scales
    elif sparse_attn.SparseAttentionKernel.can_implement(dtype, shape.head_dim, shape.block_size):
        # decode tokens, and an FP8 K/V cache's prefill tokens (the prefill kernel reads bf16 pages only)
        steps = steps._replace(bind_attention=sparse_attn.bind_attention)
    return steps


@functools.cache
def _warn_fp8_index_keys_run_the_reference() -> None:
    logger.warning(
        "FLASH_MSA: indexer_kv_dtype fp8: no CuTeDSL index-score kernel serves this index-key shape in FP8 (bf16 "
        "index queries, 128-token blocks; index head dims a multiple of 32), so the index scores run the PyTorch "
        "path on this GPU (the same FP8 scores, far slower; no full CUDA graphs)"
    )


def _index_key_writer(
    device: torch.device, dtype: torch.dtype, index_key_dtype: torch.dtype, shape: MSAShape
) -> Callable:
    """What writes index keys of this dtype into an index-key cache of index_key_dtype (its own dtype, or an FP8
    cache) on this device: the CuTeDSL kernel on Hopper where it serves the shape, else the reference (which syncs
    the host)."""
    if _on_hopper(device) and index_key_dtype in (dtype, Fp8IndexKeyCache.dtype):
        from msa_kernels.cute import index_key_write

        fp8 = index_key_dtype == Fp8IndexKeyCache.dtype
        if index_key_write.IndexKeyWriteKernel.can_implement(dtype, shape.index_head_dim, fp8):
            return index_key_write.write_index_keys
    return reference.write_index_keys


def page_resolver(device: torch.device, num_slots: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    """What resolves a host tier's decode step (msa_kernels.host_tier.resolve_step's contract) for a tier of
    num_slots device pages on this device: the CuTeDSL kernel on Hopper (one launch) for steps of at most its
    MAX_ENTRIES requests x Hi x K, else the PyTorch ops."""
    from msa_kernels import host_tier

    if not _on_hopper(device):
        return host_tier.resolve_step
    from msa_kernels.cute import page_resolve

    if not page_resolve.PageResolveKernel.can_implement(1, num_slots):
        return host_tier.resolve_step

    def resolve_step(cache, selected, host_block_table, block_table):
        fits = page_resolve.PageResolveKernel.can_implement(selected.numel(), num_slots)
        return (page_resolve.resolve_step if fits else host_tier.resolve_step)(
            cache, selected, host_block_table, block_table
        )

    return resolve_step


def selection_stats_adder(device: torch.device) -> Callable[..., None]:
    """What adds a step's selections to the metrics' totals (msa_kernels.selection_stats.add_selection_stats'
    contract) on this device: the CuTeDSL kernel on Hopper (one launch), else the PyTorch path."""
    if _on_hopper(device):
        from msa_kernels.cute import selection_stats as cute_selection_stats

        return cute_selection_stats.add_selection_stats
    from msa_kernels import selection_stats

    return selection_stats.add_selection_stats


def page_copier(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """What copies a host tier's missed pages into its device pages (msa_kernels.host_tier.copy_pages' contract) on
    this device: the CuTeDSL kernel on Hopper (no host sync: only the pages missed cross PCIe), else the reference."""
    if _on_hopper(device):
        from msa_kernels.cute import page_copy

        return page_copy.copy_pages
    from msa_kernels import host_tier

    return host_tier.copy_pages


def write_index_keys(
    index_key_cache: torch.Tensor | Fp8IndexKeyCache,
    slot_mapping: torch.Tensor,
    index_keys: torch.Tensor,
    shape: MSAShape,
) -> None:
    """Kernels.write_index_keys with the kernels chosen for these index keys and this cache."""
    chosen = kernels(index_keys.device, index_keys.dtype, index_key_cache.dtype, False, shape)
    chosen.write_index_keys(index_key_cache, slot_mapping, index_keys)


def uses_cute_index_scores(
    index_q: torch.Tensor, shape: MSAShape, phase: Phase = "decode", index_key_dtype: torch.dtype | None = None
) -> bool:
    """Whether a CuTeDSL kernel computes the index scores of this phase's part for such index queries and an
    index-key cache of index_key_dtype (None: the queries' dtype; Fp8IndexKeyCache.dtype: an FP8 cache)."""
    chosen = kernels(index_q.device, index_q.dtype, index_key_dtype or index_q.dtype, False, shape)
    return chosen.steps(phase).index_scores is not reference.index_block_scores


def uses_cute_sparse_attention(q: torch.Tensor, shape: MSAShape, phase: Phase = "decode") -> bool:
    """Whether a CuTeDSL kernel attends for this phase's part with such queries (and a bf16 K/V cache whose head dim
    is contiguous)."""
    chosen = kernels(q.device, q.dtype, q.dtype, False, shape)
    return chosen.steps(phase).bind_attention is not _bind_reference_attention


def describe(
    device: torch.device, dtype: torch.dtype, shape: MSAShape, index_key_dtype: torch.dtype | None = None
) -> str:
    """Which implementation runs each step, for startup logs (a prefill part runs CuTeDSL wherever a
    decode part does, except FP8 index scores, which the phases name apart); index_key_dtype as for
    uses_cute_index_scores. It also names what writes the index keys."""
    device, index_key_dtype = torch.device(device), index_key_dtype or dtype
    chosen = kernels(device, dtype, index_key_dtype, False, shape)
    index = _implementation(chosen.decode.index_scores is not reference.index_block_scores)
    prefill_index = _implementation(chosen.prefill.index_scores is not reference.index_block_scores)
    if prefill_index != index:
        index = f"{index} (decode), {prefill_index} (prefill)"
    topk = _implementation(chosen.decode.bind_topk is not _bind_reference_topk)
    attention = _implementation(chosen.decode.bind_attention is not _bind_reference_attention)
    described = f"index scores: {index}, top-k: {topk}, sparse attention: {attention}"
    writes = _implementation(chosen.index_key_writer is not reference.write_index_keys)
    return f"{described}, index-key writes: {writes}"


def _implementation(cute: bool) -> str:
    return "CuTeDSL" if cute else "PyTorch"


def graph_capturable(
    device: torch.device,
    dtype: torch.dtype,
    shape: MSAShape,
    index_key_dtype: torch.dtype | None = None,
) -> bool:
    """Whether a decode step of this layer can be recorded in a CUDA graph: the CuTeDSL kernels (and
    the reference top-k, torch ops) run without host syncs; the reference index scores and attention
    loop over requests on the host, and the reference's index-key write indexes by a boolean mask.
    index_key_dtype as for uses_cute_index_scores."""
    device, index_key_dtype = torch.device(device), index_key_dtype or dtype
    chosen = kernels(device, dtype, index_key_dtype, False, shape)
    if chosen.decode.bind_attention is _bind_reference_attention:
        return False
    writes = chosen.index_key_writer is not reference.write_index_keys
    return writes and chosen.decode.index_scores is not reference.index_block_scores


def index_block_scores(
    index_q: torch.Tensor, index_key_cache: torch.Tensor | Fp8IndexKeyCache, plan: StepPlan, shape: MSAShape
) -> torch.Tensor:
    """Causal max-pooled index block scores [T, Hi, max_blocks] (a mixed step's parts concatenated)."""
    chosen = kernels(index_q.device, index_q.dtype, index_key_cache.dtype, False, shape)
    scores = [
        chosen.steps(part.phase).index_scores(part.of(index_q), index_key_cache, part.batch, shape)
        for part in plan.parts
    ]
    if len(scores) == 1:
        return scores[0]
    return torch.cat(scores) if scores else reference.index_block_scores(index_q, index_key_cache, plan.batch, shape)


def select_blocks(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor | Fp8IndexKeyCache,
    plan: StepPlan,
    shape: MSAShape,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernels.select_blocks with the kernels chosen for these index queries and this index-key cache."""
    chosen = kernels(index_q.device, index_q.dtype, index_key_cache.dtype, False, shape)
    return chosen.select_blocks(index_q, index_key_cache, plan, out)


def layer_selection(plan: StepPlan, shape: MSAShape) -> torch.Tensor:
    """Where a layer call of a serving step writes its selection [T, Hi, K] int32 (select_blocks' out): the step's
    workspace, which its layers share, for a caller that consumes each layer's selection before the next layer's
    call, as the backend does (one allocation fewer per layer call: ~5 us of host time on the H200's host)."""
    return plan.workspace.selection((plan.batch.num_tokens, shape.num_index_heads, shape.topk_blocks))


def _rows(t: torch.Tensor, rows: slice | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def _score_chunks(part: PagedBatch, shape: MSAShape) -> Sequence[tuple[slice | None, PagedBatch]]:
    """[(None, part)], or, where its block scores [T, Hi, max_blocks] fp32 would pass SCORE_BYTES (a long
    prefill: one 128K-token chunk of a 1M context would need 16 GiB), runs of its tokens whose scores fit,
    scored and selected one after the other (PagedBatch.token_chunks). Decode parts always fit."""
    row_bytes = shape.num_index_heads * part.block_table.shape[1] * 4
    if part.num_tokens * row_bytes <= SCORE_BYTES:
        return [(None, part)]
    return part.token_chunks(SCORE_BYTES // row_bytes)


def sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: StepPlan,
    selected: torch.Tensor,
    shape: MSAShape,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Kernels.sparse_attention with the kernels chosen for these queries and this K/V cache (an FP8 one:
    reference.is_fp8_kv)."""
    chosen = kernels(q.device, q.dtype, q.dtype, reference.is_fp8_kv(kv_cache), shape)
    return chosen.sparse_attention(q, kv_cache, plan, selected, scale, out, kv_scales)


def msa_attention(
    q: torch.Tensor,
    index_q: torch.Tensor,
    kv_cache: torch.Tensor,
    index_key_cache: torch.Tensor | Fp8IndexKeyCache,
    plan: StepPlan,
    shape: MSAShape,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole MSA layer once the caches hold the new tokens: returns (output [T, Hq, D], selected blocks)."""
    selected = select_blocks(index_q, index_key_cache, plan, shape)
    return sparse_attention(q, kv_cache, plan, selected, shape, scale, out, kv_scales), selected
