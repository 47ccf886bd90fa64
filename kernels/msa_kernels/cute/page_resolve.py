"""CuTeDSL kernel: a host tier's decode step resolved in one launch (msa_kernels.host_tier's step_blocks + resolve,
~90 small PyTorch kernels a layer call), without a host sync.

One CTA of THREADS threads runs the step in shared memory:
  1. the step's entries (request r, selected block b: R x Hi*K) as host pages (host_block_table[r, b]; none: a
     sentinel past every page), sorted (bitonic) into the step's distinct host pages, ascending: `wanted`;
  2. each wanted page looked up in the cache (slot_of): a hit marks its slot read; misses ranked in wanted order;
  3. the CLOCK sweep from the hand over the slots the step does not read: slots without a reference bit first,
     then those with one (the sweep having cleared it), in the hand's order; the i-th miss takes the i-th; the
     bits the sweep passed are cleared and the hand moves past the last victim;
  4. a victim's old page loses its slot, then every wanted page is held by its slot, referenced; the copy list
     (host page, device page) of the misses in wanted order, -1 padded;
  5. each entry's block mapped to the device page now holding its host page, in the caller's block table (the
     blocks the step does not read keep what they held: the sparse attention reads the selected ones only).
The cache state, copy list and counts equal the reference's (msa_kernels.host_tier.resolve_step).
"""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.runtime import compiled_kernel
from msa_kernels.host_tier import PageCache, check_step_fits

if TYPE_CHECKING:
    import tvm_ffi

THREADS = 1024
WARP = 32
WARPS = THREADS // WARP
NO_PAGE = 0x7FFFFFFF  # sorts after every host page
MAX_ENTRIES = 8192  # requests x Hi x K of a step the kernel takes (its shared memory: 16 bytes an entry)
MAX_SLOTS = 65536  # device pages of a tier (a byte each in shared memory)


@dataclass(frozen=True)
class PageResolveParams:
    entries: int  # the sort's width: a power of two >= THREADS and >= the step's requests x Hi x K
    num_slots: int  # P: the tier's device pages

    @property
    def sort_stages(self) -> int:
        return self.entries.bit_length() - 1

    @property
    def entries_per_thread(self) -> int:
        return self.entries // THREADS

    @property
    def slots_per_thread(self) -> int:
        return (self.num_slots + THREADS - 1) // THREADS

    @property
    def shared_bytes(self) -> int:
        """Four int32 arrays of the sort's width, a byte a slot, the scan's exchange and the scalars, each aligned to
        16 bytes (at most 197 KiB: MAX_ENTRIES, MAX_SLOTS)."""
        return 4 * 4 * self.entries + -(-self.num_slots // 16) * 16 + 2 * WARPS * 4 + 16 + 64


def sort_width(num_entries: int) -> int:
    """The sort's width for a step of num_entries entries: the next power of two, at least THREADS."""
    return max(THREADS, 1 << max(0, num_entries - 1).bit_length())


class PageResolveKernel:
    def __init__(self, params: PageResolveParams):
        assert self.can_implement(params.entries, params.num_slots)
        self.p = params

    @classmethod
    def can_implement(cls, num_entries: int, num_slots: int) -> bool:
        return 0 < num_entries <= MAX_ENTRIES and 0 < num_slots <= MAX_SLOTS

    @staticmethod
    def fake_arguments(params: PageResolveParams) -> tuple:
        return (
            row_major(cutlass.Int32, 2),  # selected [R, Hi*K]
            row_major(cutlass.Int32, 2),  # host_block_table [R, max_blocks]
            row_major(cutlass.Int32, 1),  # pages [P]
            row_major(cutlass.Int32, 1),  # held [P]
            row_major(cutlass.Uint8, 1),  # referenced [P]
            row_major(cutlass.Int32, 1),  # slot_of [H]
            row_major(cutlass.Int64, 1),  # hand [1]
            row_major(cutlass.Int32, 2),  # block_table [R, max_blocks] (out)
            row_major(cutlass.Int32, 1),  # copy_from [R * Hi*K] (out)
            row_major(cutlass.Int32, 1),  # copy_to [R * Hi*K] (out)
            row_major(cutlass.Int32, 1),  # counts [2]: hits, misses (out)
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        selected: cute.Tensor,
        host_block_table: cute.Tensor,
        pages: cute.Tensor,
        held: cute.Tensor,
        referenced: cute.Tensor,
        slot_of: cute.Tensor,
        hand: cute.Tensor,
        block_table: cute.Tensor,
        copy_from: cute.Tensor,
        copy_to: cute.Tensor,
        counts: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.kernel(
            selected, host_block_table, pages, held, referenced, slot_of, hand, block_table, copy_from, copy_to, counts
        ).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], smem=self.p.shared_bytes, stream=stream)

    @cute.kernel
    def kernel(
        self,
        selected: cute.Tensor,
        host_block_table: cute.Tensor,
        pages: cute.Tensor,
        held: cute.Tensor,
        referenced: cute.Tensor,
        slot_of: cute.Tensor,
        hand: cute.Tensor,
        block_table: cute.Tensor,
        copy_from: cute.Tensor,
        copy_to: cute.Tensor,
        counts: cute.Tensor,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        width = cute.size(selected, mode=[1])
        num_entries = cute.size(selected, mode=[0]) * width
        smem = cutlass.memory.SmemAllocator()
        keys = smem.allocate_tensor(cutlass.Int32, cute.make_layout(p.entries), byte_alignment=16)
        wanted = smem.allocate_tensor(cutlass.Int32, cute.make_layout(p.entries), byte_alignment=16)
        wanted_slot = smem.allocate_tensor(cutlass.Int32, cute.make_layout(p.entries), byte_alignment=16)
        victims = smem.allocate_tensor(cutlass.Int32, cute.make_layout(p.entries), byte_alignment=16)
        slot_read = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(p.num_slots), byte_alignment=16)
        exchange = smem.allocate_tensor(cutlass.Int32, cute.make_layout((2, WARPS), stride=(WARPS, 1)))
        scalars = smem.allocate_tensor(cutlass.Int32, cute.make_layout(4))  # the last victim's position

        # 1. The entries' host pages, sorted.
        for slot in range(tidx, p.num_slots, THREADS):
            slot_read[slot] = cutlass.Uint8(0)
        for e in range(tidx, p.entries, THREADS):
            key = cutlass.Int32(NO_PAGE)
            if e < num_entries:
                row = e // width
                block = selected[row, e % width]
                if block >= 0:
                    key = host_block_table[row, block]
            keys[e] = key
        cute.arch.sync_threads()
        for stage in range(p.sort_stages):
            size = cutlass.Int32(2) << stage
            for step in range(stage + 1):
                distance = size >> (step + 1)
                for e in range(tidx, p.entries, THREADS):
                    partner = e ^ distance
                    if partner > e:
                        a = keys[e]
                        b = keys[partner]
                        ascending = (e & size) == 0
                        if (a > b) == ascending:
                            keys[e] = b
                            keys[partner] = a
                cute.arch.sync_threads()

        # Distinct pages, in order: thread t owns sorted entries [t * n, (t + 1) * n).
        first_entry = tidx * p.entries_per_thread
        distinct = cutlass.Int32(0)
        for q in range(p.entries_per_thread):
            distinct += self.starts_run(keys, first_entry + q)
        before, num_wanted, _, _ = self.block_scan(distinct, cutlass.Int32(0), exchange)
        for q in range(p.entries_per_thread):
            if self.starts_run(keys, first_entry + q) != 0:
                wanted[before] = keys[first_entry + q]
                before += 1
        cute.arch.sync_threads()

        # 2. Hits and misses; thread t owns wanted pages [t * n, (t + 1) * n).
        hits = cutlass.Int32(0)
        misses = cutlass.Int32(0)
        for q in range(p.entries_per_thread):
            i = first_entry + q
            if i < num_wanted:
                slot = slot_of[wanted[i]]
                wanted_slot[i] = slot
                if slot >= 0:
                    slot_read[slot] = cutlass.Uint8(1)
                    hits += 1
                else:
                    misses += 1
        miss_rank, num_misses, _, num_hits = self.block_scan(misses, hits, exchange)
        for q in range(p.entries_per_thread):  # a miss keeps its rank, encoded below -1, until its slot is known
            i = first_entry + q
            if i < num_wanted and wanted_slot[i] < 0:
                wanted_slot[i] = -2 - miss_rank
                miss_rank += 1
        cute.arch.sync_threads()

        # 3. The clock sweep; thread t owns the positions [t * m, (t + 1) * m) after the hand.
        start = cutlass.Int32(hand[0])
        first_position = tidx * p.slots_per_thread
        unset = cutlass.Int32(0)
        second = cutlass.Int32(0)
        for q in range(p.slots_per_thread):
            position = first_position + q
            if position < p.num_slots:
                slot = (start + position) % p.num_slots
                if slot_read[slot] == 0:
                    if referenced[slot] == 0:
                        unset += 1
                    else:
                        second += 1
        unset_before, num_unset, second_before, _ = self.block_scan(unset, second, exchange)
        for q in range(p.slots_per_thread):
            position = first_position + q
            if position < p.num_slots:
                slot = (start + position) % p.num_slots
                if slot_read[slot] == 0:
                    rank = cutlass.Int32(0)
                    if referenced[slot] == 0:
                        rank = unset_before
                        unset_before += 1
                    else:
                        rank = num_unset + second_before
                        second_before += 1
                    if rank < num_misses:
                        victims[rank] = slot
                    if rank == num_misses - 1:
                        scalars[0] = position
        cute.arch.sync_threads()
        last = scalars[0]
        if num_misses > 0:
            for q in range(p.slots_per_thread):
                position = first_position + q
                if position < p.num_slots and (position <= last or num_misses > num_unset):
                    referenced[(start + position) % p.num_slots] = cutlass.Uint8(0)
            if tidx == 0:
                hand[0] = cutlass.Int64((start + last + 1) % p.num_slots)

        # 4. Victims leave their old pages, then every wanted page is held by its slot; the copy list.
        for q in range(p.entries_per_thread):
            i = first_entry + q
            if i < num_wanted:
                slot = wanted_slot[i]
                if slot < 0:
                    slot = victims[-2 - slot]
                    evicted = held[slot]
                    if evicted >= 0:
                        slot_of[evicted] = -1
        cute.arch.sync_threads()
        for q in range(p.entries_per_thread):
            i = first_entry + q
            if i < num_entries:
                source = cutlass.Int32(-1)
                target = cutlass.Int32(-1)
                if i < num_wanted:
                    page = wanted[i]
                    slot = wanted_slot[i]
                    if slot < 0:
                        slot = victims[-2 - slot]
                        source = page
                        target = pages[slot]
                    slot_of[page] = slot
                    held[slot] = page
                    referenced[slot] = cutlass.Uint8(1)
                copy_from[i] = source
                copy_to[i] = target
        if tidx == 0:
            counts[0] = num_hits
            counts[1] = num_misses
        cute.arch.sync_threads()

        # 5. Each entry's block to the device page holding its host page.
        for e in range(tidx, num_entries, THREADS):
            row = e // width
            block = selected[row, e % width]
            if block >= 0:
                block_table[row, block] = pages[slot_of[host_block_table[row, block]]]

    @cute.jit
    def starts_run(self, keys: cute.Tensor, e: cutlass.Int32) -> cutlass.Int32:
        """1 where sorted entry e is a host page unlike the entry before it."""
        previous = cutlass.Int32(NO_PAGE)
        if e > 0:
            previous = keys[e - 1]
        starts = cutlass.Int32(0)
        if keys[e] != NO_PAGE and keys[e] != previous:
            starts = 1
        return starts

    @cute.jit
    def block_scan(self, a: cutlass.Int32, b: cutlass.Int32, exchange: cute.Tensor):
        """Exclusive prefix sums over the CTA's threads of two counts, and their totals:
        (a before this thread, a total, b before, b total)."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        a_incl, b_incl = a, b
        for step in cutlass.range_constexpr(5):
            a_up = cute.arch.shuffle_sync_up(a_incl, 1 << step)
            b_up = cute.arch.shuffle_sync_up(b_incl, 1 << step)
            if lane >= 1 << step:
                a_incl += a_up
                b_incl += b_up
        cute.arch.sync_threads()  # the previous scan's totals are read
        if lane == WARP - 1:
            exchange[0, warp] = a_incl
            exchange[1, warp] = b_incl
        cute.arch.sync_threads()
        a_before, b_before = a_incl - a, b_incl - b
        a_total = cutlass.Int32(0)
        b_total = cutlass.Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            if w < warp:
                a_before += exchange[0, w]
                b_before += exchange[1, w]
            a_total += exchange[0, w]
            b_total += exchange[1, w]
        return a_before, a_total, b_before, b_total


def resolve_step(
    cache: PageCache, selected: torch.Tensor, host_block_table: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as msa_kernels.host_tier.resolve_step on the GPU, for a step of at most MAX_ENTRIES entries
    (requests x Hi x K) and a tier of at most MAX_SLOTS pages; the blocks the step does not read keep their entries
    of block_table."""
    rows = selected.shape[0]
    flat = selected.reshape(rows, -1)
    check_step_fits(cache, rows, flat.shape[1])
    num_entries = flat.numel()
    copy_from = torch.empty(num_entries, dtype=torch.int32, device=selected.device)
    copy_to = torch.empty_like(copy_from)
    counts = torch.empty(2, dtype=torch.int32, device=selected.device)
    if rows:
        _kernel(sort_width(num_entries), cache.num_pages)(
            flat,
            host_block_table,
            cache.pages,
            cache.held,
            cache.referenced.view(torch.uint8),
            cache.slot_of,
            cache.hand,
            block_table,
            copy_from,
            copy_to,
            counts,
        )
    else:
        counts.zero_()
    return copy_from, copy_to, counts[0], counts[1]


@functools.cache
def _kernel(entries: int, num_slots: int) -> "tvm_ffi.Function":
    return compiled_kernel(PageResolveKernel, PageResolveParams(entries, num_slots))
