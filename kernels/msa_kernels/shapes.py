"""The shape parameters of one MSA layer and the paged batch it runs on.

Every MSA implementation (the PyTorch reference, the CuTeDSL kernels) takes these two objects, so
callers describe a layer and a batch once. The math is in docs/MSA_SPEC.md.

A step's batch is split once into its decode requests and its prefill requests (PagedBatch.split, decodes first
as vLLM's scheduler orders them), by the step's plan (msa_kernels.plan); msa_kernels.ops picks each part's kernels
by its phase.
A decode request brings one new token, or under speculative decoding 1 + the drafted tokens it verifies:
the decode kernels run every token on its own, causal by its position, so any such request is a decode.
"""

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch

Phase = Literal["decode", "prefill", "mixed"]
SINGLE_TOKEN_DECODE_QUERY_LEN = 1  # a decode request's new tokens without speculative decoding


@dataclass(frozen=True)
class MSAShape:
    """Head counts, dims and block-selection parameters of one sparse layer."""

    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    num_index_heads: int  # Hi: index head p serves main heads [p*m, (p+1)*m), m = Hq / Hi
    num_index_key_heads: int  # Hki: shared index keys, repeat_interleave'd over index heads
    index_head_dim: int  # Dp
    topk_blocks: int  # K, forced blocks included
    local_blocks: int = 1  # L: the query's own block and the L-1 before it
    init_blocks: int = 0  # I: blocks 0..I-1
    block_size: int = 128  # B: tokens per block == tokens per KV page

    def __post_init__(self) -> None:
        problems = []
        if min(self.num_q_heads, self.num_kv_heads, self.head_dim) < 1:
            problems.append("head counts and head_dim must be >= 1")
        if self.num_q_heads % self.num_kv_heads:
            problems.append(f"num_q_heads {self.num_q_heads} % num_kv_heads {self.num_kv_heads} != 0")
        if self.num_index_heads < 1 or self.num_index_heads % self.num_kv_heads:
            problems.append(
                f"num_index_heads {self.num_index_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        elif self.num_q_heads % self.num_index_heads:
            problems.append(f"num_q_heads {self.num_q_heads} % num_index_heads {self.num_index_heads} != 0")
        if self.num_index_key_heads < 1 or self.num_index_heads % self.num_index_key_heads:
            problems.append(
                f"num_index_heads {self.num_index_heads} must be a multiple of "
                f"num_index_key_heads {self.num_index_key_heads}"
            )
        if self.index_head_dim < 1 or self.block_size < 1:
            problems.append("index_head_dim and block_size must be >= 1")
        if self.local_blocks < 1 or self.init_blocks < 0:
            problems.append("local_blocks must be >= 1 and init_blocks >= 0")
        if self.topk_blocks < self.local_blocks + self.init_blocks:
            problems.append(
                f"topk_blocks {self.topk_blocks} < local_blocks {self.local_blocks} + init_blocks {self.init_blocks}"
            )
        if problems:
            raise ValueError("invalid MSA shape: " + "; ".join(problems))

    @property
    def heads_per_index_head(self) -> int:
        return self.num_q_heads // self.num_index_heads

    @property
    def index_heads_per_key_head(self) -> int:
        return self.num_index_heads // self.num_index_key_heads


# One MSA layer of MiniMax-M3 (the production MSA model): the shape the kernels are tuned and benchmarked at.
M3_SHAPE = MSAShape(
    num_q_heads=64,
    num_kv_heads=4,
    head_dim=128,
    num_index_heads=4,
    num_index_key_heads=1,
    index_head_dim=128,
    topk_blocks=16,
)


@dataclass
class PagedBatch:
    """A varlen batch of query tokens against paged caches, in vLLM's terms.

    Request r owns query tokens query_start_loc[r]:query_start_loc[r+1]; they are the last tokens of
    its seq_lens[r] tokens (cached context + new tokens), so token i of r sits at position
    seq_lens[r] - q_len[r] + i. Logical block b of r lives in physical page block_table[r, b].
    A full CUDA graph replays on a padded batch: requests with seq_len 0 and no tokens, and tokens
    past query_start_loc[-1] at position -1, which see no key (every step selects nothing for them).

    phase: "decode" (every request brings at most the split's max_decode_query_len tokens: one, or a
    speculative verification), "prefill" (prefill and chunked-prefill requests, any number of tokens) or
    "mixed" (not split yet: see split).
    query_start_loc_cpu: the host's copy of query_start_loc (vLLM's builder has it: building never syncs the
    device); copied from the device where not given.
    """

    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    phase: Phase = "mixed"
    query_start_loc_cpu: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        """int32 index tensors, as the kernels take them. vLLM's builder buffers already are, so they pass
        as they are (a full CUDA graph replays on those very buffers); other callers' are converted here."""
        for name in ("query_start_loc", "seq_lens", "block_table"):
            if getattr(self, name).dtype != torch.int32:
                setattr(self, name, getattr(self, name).to(torch.int32))
        if not self.query_start_loc_cpu:
            self.query_start_loc_cpu = self.query_start_loc.tolist()

    @cached_property
    def seq_lens_cpu(self) -> list[int]:
        return self.seq_lens.tolist()

    @property
    def query_lens_cpu(self) -> list[int]:
        starts = self.query_start_loc_cpu
        return [end - start for start, end in zip(starts, starts[1:])]

    def split(
        self, num_decode_requests: int | None = None, max_decode_query_len: int = SINGLE_TOKEN_DECODE_QUERY_LEN
    ) -> tuple["PagedBatch | None", "PagedBatch | None"]:
        """(decode part, prefill part) of a mixed batch whose decode requests come first, as vLLM orders
        them (reorder_batch_threshold, split_decodes_and_prefills); None for a part without query tokens.

        num_decode_requests: vLLM's builder gives its count; without it, the requests before the first one
        with more than max_decode_query_len new tokens (1, or 1 + num_speculative_tokens where vLLM verifies
        drafted tokens). The parts' tensors are slices of this batch's, except the prefill part's
        query_start_loc, rebased to its first token by one device subtraction; the host copy of query_start_loc
        gives the boundaries, so splitting never syncs the device. The step's plan (msa_kernels.plan.StepPlan)
        splits once and keeps the parts: the layers of a step share them and what they compute (token
        positions, tiles).
        """
        if self.phase != "mixed":
            raise ValueError(f"split takes a mixed batch, got a {self.phase} one")
        if num_decode_requests is None:
            lens = self.query_lens_cpu
            num_decode_requests = next((r for r, n in enumerate(lens) if n > max_decode_query_len), len(lens))
        return (
            self._part(0, num_decode_requests, "decode"),
            self._part(num_decode_requests, self.num_requests, "prefill"),
        )

    def _part(self, first: int, end: int, phase: Phase) -> "PagedBatch | None":
        """Requests [first, end) as a batch of their own, or None if they bring no query token."""
        starts = self.query_start_loc_cpu[first : end + 1]
        if first >= end or starts[0] == starts[-1]:
            return None
        query_start_loc = self.query_start_loc[first : end + 1]
        return PagedBatch(
            query_start_loc=query_start_loc - starts[0] if starts[0] else query_start_loc,
            seq_lens=self.seq_lens[first:end],
            block_table=self.block_table[first:end],
            phase=phase,
            query_start_loc_cpu=[start - starts[0] for start in starts],
        )

    def token_chunks(self, max_tokens: int) -> list[tuple[slice, "PagedBatch"]]:
        """The batch's query tokens cut into runs of at most max_tokens consecutive tokens, each as a batch of
        its own with the rows of this batch's tokens it owns: a request cut between two runs appears in both,
        its earlier tokens as a chunked prefill whose context ends at its last token in the run, so every
        token keeps its position and sees the keys it saw. One run (this batch itself) where all tokens fit.
        Built from the host copy of query_start_loc: the device only subtracts, nothing syncs."""
        total = self.num_tokens
        if total <= max_tokens:
            return [(slice(0, total), self)]
        starts = self.query_start_loc_cpu
        device = self.query_start_loc.device
        chunks = []
        for first in range(0, total, max_tokens):
            end = min(first + max_tokens, total)
            r0 = bisect.bisect_right(starts, first) - 1
            r1 = bisect.bisect_left(starts, end)  # requests r0 .. r1-1 own tokens of [first, end)
            local = [max(first, starts[r]) - first for r in range(r0, r1)] + [end - first]
            cut = [starts[r + 1] - min(end, starts[r + 1]) for r in range(r0, r1)]  # their tokens past the run
            chunk = PagedBatch(
                query_start_loc=_to_device(torch.tensor(local, dtype=torch.int32), device),
                seq_lens=self.seq_lens[r0:r1] - _to_device(torch.tensor(cut, dtype=torch.int32), device),
                block_table=self.block_table[r0:r1],
                phase=self.phase,
                query_start_loc_cpu=local,
            )
            chunks.append((slice(first, end), chunk))
        return chunks

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @cached_property
    def _tokens(self) -> torch.Tensor:
        """0 .. num_tokens - 1 on the batch's device, int32: what token_requests and positions count from."""
        return torch.arange(self.num_tokens, dtype=torch.int32, device=self.query_start_loc.device)

    @cached_property
    def token_requests(self) -> torch.Tensor:
        """Request index of every query token, [num_tokens] int32.

        Computed on the device without a host sync or data-dependent shape, so a CUDA graph can
        record it and replay it on a padded batch: tokens past query_start_loc[-1] (padding) get
        the last request.
        """
        requests = torch.searchsorted(self.query_start_loc[1:], self._tokens, right=True, out_int32=True)
        return requests.clamp_(max=max(0, self.num_requests - 1))

    @cached_property
    def positions(self) -> torch.Tensor:
        """Position of every query token in its sequence, [num_tokens] int32 (as the kernels take it);
        -1 for padding tokens. Token i of the step, of request r, sits at seq_lens[r] - query_start_loc[r + 1] + i
        (r's last token at seq_lens[r] - 1): one subtraction a request, one gather and one addition a token, int32
        throughout, then the padding masked."""
        ends = self.query_start_loc[1:]
        positions = (self.seq_lens - ends).index_select(0, self.token_requests).add_(self._tokens)
        return positions.masked_fill_(self._tokens >= ends[-1:], -1)

    def request_tiles(self, tile_tokens: int) -> torch.Tensor:
        """[tiles, 3] int32 rows (request, first token, end token) on the batch's device: each request's
        query tokens cut into runs of at most tile_tokens consecutive tokens (the prefill kernels'
        tiles). Built on the host once per batch and tile size, so the layers of a step share it."""
        cache = self.__dict__.setdefault("_request_tiles", {})
        if tile_tokens not in cache:
            starts = torch.tensor(self.query_start_loc_cpu, dtype=torch.int64)
            lengths = starts[1:] - starts[:-1]
            per_request = (lengths + tile_tokens - 1) // tile_tokens
            request = torch.repeat_interleave(torch.arange(len(lengths)), per_request)
            first_tile = torch.cumsum(per_request, 0) - per_request
            first = starts[request] + (torch.arange(len(request)) - first_tile[request]) * tile_tokens
            end = torch.minimum(first + tile_tokens, starts[request + 1])
            tiles = torch.stack((request, first, end), dim=1).to(torch.int32)
            cache[tile_tokens] = _to_device(tiles, self.query_start_loc.device)
        return cache[tile_tokens]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor copied to `device` without waiting for the device: from pinned memory, asynchronously
    (a blocking copy, or an asynchronous one from pageable memory, may synchronize the stream: the host would
    wait for every kernel queued before it, once per prefill step)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
