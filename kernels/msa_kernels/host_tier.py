"""The K/V host tier's step: which device pages hold the pages a decode step reads, and what is copied in first.

An MSA decode step reads the K/V of at most Hi x K blocks per request (each index head's top-k), and consecutive
steps read many of the same blocks (results/README.md, "Selection reuse across decode steps"). With a host tier the
K/V of every page lives in host memory, at the page vLLM's block table names (host_block_table: the pages are
vLLM's block ids), and a layer's device tier is a PageCache: `num_pages` device pages holding copies of host pages,
replaced by the CLOCK policy (least recently used, approximately: a reference bit a page and a hand, no sort, so one
thread block can run a step of it). The cache is keyed by host page, not by request or batch row: vLLM moves
requests between batch rows from step to step and hands a freed page to the next request, and a page of a prefix
shared by several requests is one copy for all of them. Per decode step, after top-k:

    selected [R, Hi, K] --step_blocks--> the step's blocks [R, Hi*K] (each once, -1 padded)
        --resolve(cache, host_block_table)--> Resolution: the block table the sparse attention reads (block -> the
                  device page holding its host page, for the step's blocks only), the host pages to copy in and the
                  device pages they fill
        --copy_pages(copy_from, copy_to)--> the device pages hold every page the step reads; sparse attention runs
                  unchanged on them

and every K/V write goes to its host page and, where a device page holds a copy of that page, to the copy too
(PageCache.device_slots: the write-through slots), so a copy never goes stale: not when the step's token lands in
its own block (read every step), nor when a freed page is written by the request it goes to next.

The sparse attention reads only the selected blocks' pages (msa_kernels.reference.sparse_attention, the CuTeDSL
kernels), so the resolved block table is the only change it sees. resolve and device_slots are torch ops on the
device without a host sync or data-dependent shapes (resolve_step: step_blocks + resolve, ~90 small kernels on a GPU;
msa_kernels.cute.page_resolve the one-launch kernel, msa_kernels.ops.page_resolver chooses); copy_pages here is the
reference (it indexes by a mask, which syncs a GPU's host), msa_kernels.cute.page_copy the kernel
(msa_kernels.ops.page_copier chooses). vllm_msa/host_tier.py serves it.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass
class PageCache:
    """A layer's device tier: `num_pages` device pages caching host pages, replaced by the CLOCK policy.

    pages [P] int32: the device page of each slot (fixed);
    held [P] int32: the host page each slot holds a copy of, -1 = none;
    referenced [P] bool: the slot was read since the clock hand last passed it (a second chance);
    slot_of [H] int32: the slot holding each of the H host pages, -1 = none (what lookups and writes read);
    hand [1] int64: the slot the clock hand points at (on the device: resolve moves it without a host sync)."""

    pages: torch.Tensor
    held: torch.Tensor
    referenced: torch.Tensor
    slot_of: torch.Tensor
    hand: torch.Tensor

    @classmethod
    def empty(
        cls, num_pages: int, num_host_pages: int, device: torch.device | str = "cpu", first_page: int = 0
    ) -> "PageCache":
        """An empty cache on device pages first_page + [0, num_pages) for num_host_pages host pages."""
        pages = torch.arange(first_page, first_page + num_pages, dtype=torch.int32, device=device)
        return cls(
            pages,
            torch.full_like(pages, -1),
            torch.zeros(num_pages, dtype=torch.bool, device=device),
            torch.full((num_host_pages,), -1, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    def device_slots(self, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
        """The device slots [T] int64 a K/V write at host slots slot_mapping [T] also goes to: the same row of the
        page's copy where a device page holds one, else -1 (as padding: skipped)."""
        host_page = torch.where(slot_mapping >= 0, slot_mapping // block_size, 0).long()
        slot = self.slot_of[host_page].long()
        device_page = self.pages[slot.clamp(min=0)].long()
        copied = (slot_mapping >= 0) & (slot >= 0)
        return torch.where(copied, device_page * block_size + slot_mapping % block_size, -1)


class Resolution(NamedTuple):
    """Where a decode step's blocks are read from, and what must be copied in before the step reads them.

    block_table [R, max_blocks] int32: the device page of each block the step reads (others -1);
    copy_from [N] int32: the host pages to copy in (a page the step reads that no device page held), -1 padded;
    copy_to [N] int32: the device page each is copied into (-1 where copy_from is);
    hits [] int32: the step's distinct pages a device page held already."""

    block_table: torch.Tensor
    copy_from: torch.Tensor
    copy_to: torch.Tensor
    hits: torch.Tensor

    @property
    def misses(self) -> torch.Tensor:
        """[] int32: the step's pages copied in from host memory."""
        return (self.copy_from >= 0).sum(dtype=torch.int32)


def _unique_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row's values >= 0, each once, ascending, then -1 (values [rows, n] int)."""
    ordered = values.sort(dim=1).values
    repeated = torch.zeros_like(ordered, dtype=torch.bool)
    repeated[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    high = torch.iinfo(ordered.dtype).max
    ordered = ordered.masked_fill(repeated | (ordered < 0), high).sort(dim=1).values
    return ordered.masked_fill(ordered == high, -1)


def step_blocks(selected: torch.Tensor) -> torch.Tensor:
    """The blocks each request's decode token reads, [R, Hi*K] int32: the union of its index heads' selected blocks
    (selected [R, Hi, K], -1 = none), each once, ascending, then -1."""
    return _unique_rows(selected.flatten(1)).to(torch.int32)


def _clock_victims(cache: PageCache, slot_read: torch.Tensor, num_misses: torch.Tensor) -> torch.Tensor:
    """The slots the step's misses take, in the order the clock hand reaches them ([P]: victim i at [i], the rest
    past the misses unspecified), and the hand and reference bits moved as the sweep leaves them (in place).

    The hand sweeps from where it points, skipping the slots the step reads; an unread slot whose reference bit is
    set loses it (a second chance), one without is taken. Vectorised: the slots without a bit come first in the
    hand's order, then (the sweep having wrapped round and cleared every bit) those with one."""
    num_pages = cache.num_pages
    position = torch.arange(num_pages, device=slot_read.device)
    order = (cache.hand + position) % num_pages  # the slots in the order the hand reaches them
    unread = ~slot_read[order]
    referenced = cache.referenced[order]
    first = unread & ~referenced
    second = unread & referenced
    num_first = first.sum()
    rank = torch.where(first, first.cumsum(0) - 1, torch.where(second, num_first + second.cumsum(0) - 1, num_pages))
    victims = torch.empty(num_pages + 1, dtype=torch.int64, device=slot_read.device)
    victims.scatter_(0, rank, order)
    place = torch.zeros(num_pages + 1, dtype=torch.int64, device=slot_read.device)  # where the hand finds victim i
    place.scatter_(0, rank, position)
    last = place.gather(0, (num_misses - 1).clamp(min=0).view(1))  # [1]: where the hand takes the step's last victim
    swept = num_misses > 0
    passed = swept & ((position <= last) | (num_misses > num_first))
    cache.referenced.scatter_(0, order, referenced & ~passed)
    cache.hand.copy_(torch.where(swept, (cache.hand + last + 1) % num_pages, cache.hand))
    return victims[:num_pages]


def check_step_fits(cache: PageCache, rows: int, width: int) -> None:
    """Refuse a step of rows requests x width blocks (Hi x K) that a cache of fewer pages could not hold: a miss
    would find no slot."""
    if cache.num_pages < rows * width:
        raise ValueError(
            f"a device tier of {cache.num_pages} pages cannot hold a step's {rows} x {width} blocks (requests x Hi x K)"
        )


def resolve(cache: PageCache, blocks: torch.Tensor, host_block_table: torch.Tensor) -> Resolution:
    """Give every block of the step (blocks [R, N] from step_blocks) the device page holding a copy of its host page
    (host_block_table [R, max_blocks]): a page already held keeps its device page (a hit); the pages held nowhere
    (ascending) take the slots the clock hand picks among those the step does not read, and are to be copied in.
    Updates the cache in place (the pages held, the reference bits: set on every slot the step reads, the hand).
    Needs num_pages >= R x N, so every miss finds a slot whatever the step reads. Torch ops of fixed shapes: no host
    sync."""
    rows, width = blocks.shape
    check_step_fits(cache, rows, width)
    read = blocks >= 0
    host_page = torch.where(read, host_block_table.gather(1, blocks.clamp(min=0).long()), -1)
    wanted = _unique_rows(host_page.view(1, -1))[0]  # [R*N]: the step's distinct host pages, -1 padded
    present = wanted >= 0
    slot = torch.where(present, cache.slot_of[wanted.clamp(min=0).long()], -1)
    hit = present & (slot >= 0)
    miss = present & (slot < 0)
    num_pages = cache.num_pages
    sink = torch.full_like(wanted, num_pages).long()  # past the real slots: where entries without a slot write
    slot_read = torch.zeros(num_pages + 1, dtype=torch.bool, device=blocks.device)
    slot_read.scatter_(0, torch.where(hit, slot.long(), sink), True)
    victims = _clock_victims(cache, slot_read[:num_pages], miss.sum())
    slot = torch.where(miss, victims[(miss.cumsum(0) - 1).clamp(min=0)].to(slot.dtype), slot).long()
    # A slot taken by a miss stops holding its old page; then each read slot holds its page, referenced.
    evicted = torch.where(miss, cache.held[slot.clamp(min=0, max=num_pages - 1)], -1).long()
    host_sink = cache.slot_of.shape[0]
    slot_of = torch.cat([cache.slot_of, cache.slot_of.new_full((1,), -1)])
    slot_of.scatter_(0, torch.where(evicted >= 0, evicted, host_sink), -1)
    target = torch.where(present, slot, sink)
    slot_of.scatter_(0, torch.where(present, wanted.long(), host_sink), target.to(slot_of.dtype))
    held = torch.cat([cache.held, cache.held.new_full((1,), -1)])
    held.scatter_(0, target, wanted.to(held.dtype))
    referenced = torch.cat([cache.referenced, cache.referenced.new_zeros(1)])
    referenced.scatter_(0, target, True)
    cache.slot_of.copy_(slot_of[:host_sink])
    cache.held.copy_(held[:num_pages])
    cache.referenced.copy_(referenced[:num_pages])
    # Each row's blocks to the device page now holding their host page.
    device_page = cache.pages[cache.slot_of[host_page.clamp(min=0).long()].clamp(min=0).long()]
    max_blocks = host_block_table.shape[1]
    block_table = host_block_table.new_full((rows, max_blocks + 1), -1)
    block_table.scatter_(1, torch.where(read, blocks, max_blocks).long(), device_page.to(block_table.dtype))
    copy_page = cache.pages[slot.clamp(min=0)]
    return Resolution(
        block_table[:, :max_blocks].to(torch.int32),
        torch.where(miss, wanted, -1).to(torch.int32),
        torch.where(miss, copy_page, -1).to(torch.int32),
        hit.sum(dtype=torch.int32),
    )


def resolve_step(
    cache: PageCache, selected: torch.Tensor, host_block_table: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's selection [R, Hi, K] resolved (step_blocks, resolve) into block_table [R, max_blocks] (the
    device page of each block the step reads; the others -1 here, unspecified in the kernel's), with the cache
    updated in place: (copy_from, copy_to, hits, misses) as Resolution names them. What
    msa_kernels.ops.page_resolver chooses on a device without the kernel (msa_kernels/cute/page_resolve.py)."""
    resolution = resolve(cache, step_blocks(selected), host_block_table)
    block_table.copy_(resolution.block_table)
    return resolution.copy_from, resolution.copy_to, resolution.hits, resolution.misses


def copy_pages(
    host_pages: torch.Tensor, device_pages: torch.Tensor, copy_from: torch.Tensor, copy_to: torch.Tensor
) -> None:
    """Copy the missed pages (host_pages[copy_from[n]], host_pages [host pages, ...]) into their device pages
    (device_pages[copy_to[n]]; copy_from / copy_to [N] int32 from a Resolution, -1 = nothing to copy), the
    reference: it selects the copies by a mask, a host sync on a GPU (msa_kernels.ops.page_copier chooses)."""
    missing = copy_from >= 0
    source = copy_from[missing].long().to(host_pages.device)
    device_pages[copy_to[missing].long()] = host_pages[source].to(device_pages.device, non_blocking=True)
