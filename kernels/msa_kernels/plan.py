"""The step plan: one step's paged batch resolved once into its one-phase parts, each with its workspace.

vLLM's metadata builder makes the plan of every step (StepPlan.of with vLLM's count of decode requests) and every
MSA layer of the step runs on it through msa_kernels.ops: the parts are not split again per layer, and the work
tensors a layer call fills and consumes (the index scores on their way to top-k, the decode attention's split-K
partials, the step's selection) and the kernels bound to them and to the part's batch (launches) are made by the
first layer that needs them and reused by the others.
Other callers (tests, benchmarks) plan their batch once with StepPlan.of, which splits at the first request with
more new tokens than a decode brings.

    StepPlan.of(batch) -> decode part: requests with one new token, or a speculative verification's 1 + drafted
                                       tokens (first, as vLLM orders them); the decode kernels
                          prefill part: prefill and chunked-prefill requests; the prefill kernels
    each part: its PagedBatch (phase "decode" or "prefill"), the rows of the step's tokens it owns, its Workspace
"""

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from msa_kernels.shapes import SINGLE_TOKEN_DECODE_QUERY_LEN, PagedBatch, Phase

Launch = TypeVar("Launch")


class Workspace:
    """What the layers of one part of a step (or of the whole step: its selection) share, each made at the first
    call that asks for it and handed to every later call (on a GPU each allocation or launch set-up costs
    microseconds of host time per layer call):

    - work tensors, one per use: a call fills what it asks for and consumes it before it returns, so the calls of
      one step must run in one stream's order, as vLLM's layers do. A smaller ask gets the front of the largest
      made so far (a long prefill's score chunks share one);
    - launches (launch): a layer's kernels bound to the part's batch and work tensors, so a layer call passes only
      its own tensors.

    One made during CUDA-graph capture is kept apart from one made outside it, so a graph holds memory of its own
    pool only and eager calls never write a graph's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, bool], torch.Tensor] = {}
        self._views: dict[tuple[str, tuple[int, ...], bool], torch.Tensor] = {}
        self._launches: dict[tuple[Hashable, bool], Any] = {}

    def block_scores(self, size: tuple[int, int, int]) -> torch.Tensor:
        """[T, Hi, max_blocks] fp32: a part's index block scores, which top-k reads."""
        return self._tensor("block scores", size, torch.float32)

    def split_outputs(self, size: tuple[int, int, int, int]) -> torch.Tensor:
        """[splits, T, Hq, D] fp32: the decode attention's split-K partial outputs, which combine merges."""
        return self._tensor("split outputs", size, torch.float32)

    def split_log_sum_exps(self, size: tuple[int, int, int]) -> torch.Tensor:
        """[splits, T, Hq] fp32: the decode attention's split-K log-sum-exps."""
        return self._tensor("split log-sum-exps", size, torch.float32)

    def handled_rows(self, size: tuple[int, int]) -> torch.Tensor:
        """[T, Hi] int32: the prefill attention's flags of the rows it wrote (every row: no union bound is passed)."""
        return self._tensor("handled rows", size, torch.int32)

    def selection(self, size: tuple[int, int, int]) -> torch.Tensor:
        """[T, Hi, K] int32: a layer's selected blocks, which its attention reads (the step's workspace)."""
        return self._tensor("selection", size, torch.int32)

    def launch(self, key: Hashable, bind: Callable[..., Launch], *args: Any) -> Launch:
        """What bind(*args) returns (a launch bound to this part), made at the first call with this key."""
        capturing = self._capturing()
        launch = self._launches.get((key, capturing))
        if launch is None:
            launch = self._launches[(key, capturing)] = bind(*args)
        return launch

    def _tensor(self, use: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        capturing = self._capturing()
        view = self._views.get((use, size, capturing))
        if view is None:
            numel = math.prod(size)
            buffer = self._buffers.get((use, capturing))
            if buffer is None or buffer.numel() < numel:
                buffer = self._buffers[(use, capturing)] = torch.empty(numel, dtype=dtype, device=self.device)
            view = self._views[(use, size, capturing)] = buffer[:numel].view(size)
        return view

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class PlanPart:
    """One phase's requests of a step: their batch, the rows of the step's tokens they own (None: all of them, a
    step of one phase) and their workspace."""

    batch: PagedBatch
    rows: slice | None
    workspace: Workspace = field(compare=False, repr=False)

    @property
    def phase(self) -> Phase:
        return self.batch.phase

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This part's rows of a tensor with a row per token of the step."""
        return t if self.rows is None else t[self.rows]


@dataclass(frozen=True)
class StepPlan:
    """A step's batch and its parts with query tokens, the decode part first (the module docstring)."""

    batch: PagedBatch
    parts: tuple[PlanPart, ...]
    workspace: Workspace = field(compare=False, repr=False)  # the step's own: the layers' selection

    @classmethod
    def of(
        cls,
        batch: PagedBatch,
        num_decode_requests: int | None = None,
        max_decode_query_len: int = SINGLE_TOKEN_DECODE_QUERY_LEN,
    ) -> "StepPlan":
        """The plan of a batch whose decode requests come first, as vLLM orders them (reorder_batch_threshold,
        split_decodes_and_prefills). num_decode_requests: vLLM's builder gives its count; without it, the requests
        before the first one with more than max_decode_query_len new tokens (1, or 1 + num_speculative_tokens where
        vLLM verifies drafted tokens). A batch whose phase is already decode or prefill is its one part."""
        device = batch.query_start_loc.device
        if batch.phase != "mixed":
            parts = [batch] if batch.num_tokens else []
        else:
            parts = [part for part in batch.split(num_decode_requests, max_decode_query_len) if part is not None]
        planned: tuple[PlanPart, ...]
        if len(parts) == 2:  # each part owns its rows of the step's tokens
            decode, prefill = parts
            planned = (
                PlanPart(decode, slice(0, decode.num_tokens), Workspace(device)),
                PlanPart(prefill, slice(decode.num_tokens, batch.num_tokens), Workspace(device)),
            )
        else:  # one part (owning all the rows, passed without slicing) or none
            planned = tuple(PlanPart(part, None, Workspace(device)) for part in parts)
        return cls(batch, planned, Workspace(device))

    def part(self, phase: Phase) -> PlanPart | None:
        """The part of this phase ("decode" or "prefill"), or None where the step has none."""
        return next((part for part in self.parts if part.phase == phase), None)

    @property
    def positions(self) -> torch.Tensor:
        """Every query token's position, [T] int32 (PagedBatch.positions): a step of one phase has its part's, which
        the part's kernels computed, so a decode step computes them once; a two-phase step the whole batch's."""
        return self.parts[0].batch.positions if len(self.parts) == 1 else self.batch.positions

    @property
    def num_decode_tokens(self) -> int:
        """Query tokens of the decode part: the step's first rows."""
        decode = self.part("decode")
        return decode.batch.num_tokens if decode is not None else 0
