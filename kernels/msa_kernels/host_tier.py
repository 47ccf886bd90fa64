"""The K/V host tier's step: which device pages hold the blocks a decode step reads, and what is copied in first.

An MSA decode step reads the K/V of at most Hi x K blocks per request (each index head's top-k), and consecutive
steps read many of the same blocks (results/README.md, "Selection reuse across decode steps"). With a host tier the
K/V of every block lives in host memory (its page in host_block_table) and may also still be resident in a device
page (resident_block_table, -1 where spilled); each request keeps a hot set on the device: `capacity` pages holding
the spilled blocks it read last, least recently used out. Per decode step, after top-k:

    selected [R, Hi, K] --step_blocks--> the step's blocks [R, Hi*K] (each once, -1 padded)
        --resolve(hot_sets, host_block_table, resident_block_table)--> Resolution: the block table the sparse
                  attention reads (block -> its resident page or its hot page, for the step's blocks only), the host
                  pages to copy in and the hot pages they fill
        --copy_pages--> the hot pages hold every block the step reads; sparse attention runs unchanged

The sparse attention reads only the selected blocks' pages (msa_kernels.reference.sparse_attention, the CuTeDSL
kernels), so the resolved block table is the only change it sees. resolve is torch ops on the device without a host
sync or data-dependent shapes; copy_pages here is the reference (it indexes by a mask, which syncs a GPU's host).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

_NEVER = -1  # last_used of a slot that holds nothing: the first chosen for a miss


@dataclass
class HotSets:
    """Per request row, its hot set: `capacity` device pages and the blocks they hold.

    pages [R, capacity] int32: the device page of each slot (fixed; rows own disjoint pages);
    blocks [R, capacity] int32: the logical block each slot holds, -1 = none;
    last_used [R, capacity] int64: the step that last read each slot, -1 = never."""

    pages: torch.Tensor
    blocks: torch.Tensor
    last_used: torch.Tensor

    @classmethod
    def empty(
        cls, num_requests: int, capacity: int, device: torch.device | str = "cpu", first_page: int = 0
    ) -> "HotSets":
        """Hot sets of `capacity` pages each, request r's on device pages first_page + [r * capacity, (r + 1) *
        capacity)."""
        pages = torch.arange(num_requests * capacity, dtype=torch.int32, device=device).view(num_requests, capacity)
        pages += first_page
        blocks = torch.full_like(pages, -1)
        return cls(pages, blocks, torch.full(pages.shape, _NEVER, dtype=torch.int64, device=device))

    @property
    def capacity(self) -> int:
        return self.pages.shape[1]


class Resolution(NamedTuple):
    """Where a decode step's blocks are read from, and what must be copied in before the step reads them.

    block_table [R, max_blocks] int32: the device page of each block the step reads (others -1);
    copy_from [R, N] int32: per block of step_blocks' row, its host page where it misses, else -1;
    copy_to [R, N] int32: the device page a missing block is copied into (-1 where copy_from is);
    hits [R] int32: the step's spilled blocks already in the hot set;
    resident [R] int32: the step's blocks read from their resident pages."""

    block_table: torch.Tensor
    copy_from: torch.Tensor
    copy_to: torch.Tensor
    hits: torch.Tensor
    resident: torch.Tensor

    @property
    def misses(self) -> torch.Tensor:
        """[R] int32: the step's blocks copied in from host memory."""
        return (self.copy_from >= 0).sum(1, dtype=torch.int32)


def step_blocks(selected: torch.Tensor) -> torch.Tensor:
    """The blocks each request's decode token reads, [R, Hi*K] int32: the union of its index heads' selected blocks
    (selected [R, Hi, K], -1 = none), each once, ascending, then -1."""
    blocks = selected.flatten(1).sort(dim=1).values
    repeated = torch.zeros_like(blocks, dtype=torch.bool)
    repeated[:, 1:] = blocks[:, 1:] == blocks[:, :-1]
    blocks = blocks.masked_fill(repeated | (blocks < 0), torch.iinfo(blocks.dtype).max).sort(dim=1).values
    return blocks.masked_fill(blocks == torch.iinfo(blocks.dtype).max, -1).to(torch.int32)


def resolve(
    hot_sets: HotSets,
    blocks: torch.Tensor,
    host_block_table: torch.Tensor,
    step: int,
    resident_block_table: torch.Tensor | None = None,
) -> Resolution:
    """Give every block of the step (blocks [R, N] from step_blocks) a device page: its resident page where
    resident_block_table [R, max_blocks] has one (>= 0; None: every block spilled), else a page of its request's hot
    set: a block already held keeps its page (a hit); a missing block takes the least recently used slot that the
    step does not read (empty slots first) and is to be copied in from its host page (host_block_table [R,
    max_blocks]). Updates hot_sets in place (the blocks held, their last use: `step`). Needs capacity >= N, so every
    miss finds a slot."""
    if hot_sets.capacity < blocks.shape[1]:
        raise ValueError(
            f"a hot set of {hot_sets.capacity} pages cannot hold a step's {blocks.shape[1]} blocks (Hi x K)"
        )
    rows, capacity = hot_sets.blocks.shape
    read = blocks >= 0
    gather_at = blocks.clamp(min=0).long()
    if resident_block_table is None:
        resident_page = torch.full_like(blocks, -1)
    else:
        resident_page = torch.where(read, resident_block_table.gather(1, gather_at), -1)
    spilled = read & (resident_page < 0)  # the blocks the hot set serves
    held = (blocks[:, :, None] == hot_sets.blocks[:, None, :]) & spilled[:, :, None]  # [R, N, capacity]
    hit = held.any(2)
    slot_read = held.any(1)  # [R, capacity]: slots the step reads already
    miss = spilled & ~hit
    # The misses of a row take its unread slots in order of last use (never used first), one each.
    free_first = torch.where(slot_read, torch.iinfo(torch.int64).max, hot_sets.last_used).argsort(dim=1, stable=True)
    miss_slot = free_first.gather(1, (miss.cumsum(1) - 1).clamp(min=0))
    slot = torch.where(hit, held.to(torch.int8).argmax(2), miss_slot)
    # Entries the hot set does not serve (no block, or a resident one) write a sink column past the real ones.
    target = torch.where(spilled, slot, capacity)
    held_blocks = torch.cat([hot_sets.blocks, hot_sets.blocks.new_full((rows, 1), -1)], 1)
    held_blocks.scatter_(1, target, blocks)
    last_used = torch.cat([hot_sets.last_used, hot_sets.last_used.new_full((rows, 1), _NEVER)], 1)
    last_used.scatter_(1, target, step)
    hot_sets.blocks.copy_(held_blocks[:, :capacity])
    hot_sets.last_used.copy_(last_used[:, :capacity])
    hot_page = torch.where(spilled, hot_sets.pages.gather(1, slot), -1)
    page = torch.where(resident_page >= 0, resident_page, hot_page)
    max_blocks = host_block_table.shape[1]
    block_table = host_block_table.new_full((rows, max_blocks + 1), -1)
    block_table.scatter_(1, torch.where(read, blocks, max_blocks).long(), page.to(block_table.dtype))
    copy_from = torch.where(miss, host_block_table.gather(1, gather_at), -1)
    return Resolution(
        block_table[:, :max_blocks].to(torch.int32),
        copy_from.to(torch.int32),
        torch.where(miss, hot_page, -1).to(torch.int32),
        hit.sum(1, dtype=torch.int32),
        (resident_page >= 0).sum(1, dtype=torch.int32),
    )


def copy_pages(host_kv: torch.Tensor, device_kv: torch.Tensor, resolution: Resolution) -> None:
    """Copy the missing blocks' K/V pages (host_kv [host pages, ...]) into their hot pages (device_kv [device pages,
    ...]), the reference: it selects the copies by a mask, a host sync on a GPU."""
    missing = resolution.copy_from >= 0
    source = resolution.copy_from[missing].long().to(host_kv.device)
    device_kv[resolution.copy_to[missing].long()] = host_kv[source].to(device_kv.device, non_blocking=True)
