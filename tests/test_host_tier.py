"""The K/V host tier's step (msa_kernels.host_tier) on CPU: the sparse attention through the device tier reads exactly
what it reads from the whole cache, whichever batch row a request is in, with pages freed and written by the next
request, and the device tier keeps the pages the CLOCK policy keeps."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msa_kernels import reference
from msa_kernels.host_tier import PageCache, copy_pages, resolve, step_blocks
from msa_kernels.shapes import PagedBatch
from msa_kernels.testing import make_case, small_shape

SHAPE = small_shape(topk_blocks=4, local_blocks=2, init_blocks=1)  # 16-token blocks, Hi 2: a step reads <= 8 blocks
# Contexts off the block grid, one shorter than K blocks, one of many blocks.
SEQ_LENS = [37, 201, 64, 530]
STEP_WIDTH = SHAPE.num_index_heads * SHAPE.topk_blocks  # the most blocks one request's step reads


def test_step_blocks_is_each_requests_union_of_its_index_heads_blocks():
    g = torch.Generator().manual_seed(1)
    selected = torch.randint(-1, 9, (5, 3, 4), generator=g, dtype=torch.int32)
    blocks = step_blocks(selected)
    assert blocks.shape == (5, 12) and blocks.dtype == torch.int32
    for row, want in zip(blocks.tolist(), selected.flatten(1).tolist()):
        union = sorted({b for b in want if b >= 0})
        assert row == union + [-1] * (12 - len(union))


def decode_steps(num_steps: int, seed: int):
    """A decode batch (one query token per request at SEQ_LENS; free pages and page tails NaN) and, per step, the
    batch with its requests in a new order of rows (as vLLM reorders them), fresh queries and the reference's
    selection for them: each step selects other blocks, as consecutive decode steps do."""
    case = make_case(SHAPE, [1] * len(SEQ_LENS), SEQ_LENS, dtype=torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(num_steps):
        rows = torch.randperm(len(SEQ_LENS), generator=g)
        batch = PagedBatch(
            case.batch.query_start_loc, case.batch.seq_lens[rows], case.batch.block_table[rows], "decode"
        )
        index_q = torch.randn(case.index_q.shape, generator=g, dtype=torch.float64)
        q = torch.randn(case.q.shape, generator=g, dtype=torch.float64)
        scores = reference.index_block_scores(index_q, case.index_key_cache, batch, SHAPE)
        yield case, batch, q, reference.topk_blocks(scores, batch.positions, SHAPE)


def device_tier(host_kv: torch.Tensor, num_pages: int) -> tuple[PageCache, torch.Tensor]:
    """A PageCache of num_pages device pages, and the device K/V: NaN until a page is copied in."""
    device_kv = torch.full((num_pages, *host_kv.shape[1:]), float("nan"), dtype=host_kv.dtype)
    return PageCache.empty(num_pages, host_kv.shape[0]), device_kv


def attend_through(cache: PageCache, device_kv, host_kv, batch: PagedBatch, q, selected, scale: float):
    """One decode step through the device tier: resolve, copy in, the sparse attention on the device pages."""
    resolution = resolve(cache, step_blocks(selected), batch.block_table)
    copy_pages(host_kv, device_kv, resolution.copy_from, resolution.copy_to)
    device_batch = PagedBatch(batch.query_start_loc, batch.seq_lens, resolution.block_table, "decode")
    return reference.sparse_attention(q, device_kv, device_batch, selected, SHAPE, scale), resolution


def write_rows(kv: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """K/V rows [T, 2, Hkv, D] at flat slots [T] (-1: skipped) of a paged K/V [pages, 2, B, Hkv, D]."""
    keep = slots >= 0
    slots = slots[keep]
    kv[slots // SHAPE.block_size, :, slots % SHAPE.block_size] = rows[keep]


@pytest.mark.parametrize("num_pages", [len(SEQ_LENS) * STEP_WIDTH, 45, 64])  # the least, more, every page
def test_attention_through_the_device_tier_equals_attention_on_the_whole_cache(num_pages):
    steps = list(decode_steps(12, seed=num_pages))
    case = steps[0][0]
    host_kv = case.kv_cache  # every page's K/V at home in host memory
    cache, device_kv = device_tier(host_kv, num_pages)
    seen: set[int] = set()
    for step, (_, batch, q, selected) in enumerate(steps):
        held_before = set(cache.held.tolist())
        through, resolution = attend_through(cache, device_kv, host_kv, batch, q, selected, case.scale)
        whole = reference.sparse_attention(q, host_kv, batch, selected, SHAPE, case.scale)
        assert torch.equal(through, whole), f"step {step}"
        blocks = step_blocks(selected)
        pages = {int(batch.block_table[r, b]) for r, row in enumerate(blocks.tolist()) for b in row if b >= 0}
        assert int(resolution.hits) == len(pages & held_before) and int(resolution.misses) == len(pages - held_before)
        held = [p for p in cache.held.tolist() if p >= 0]
        assert pages <= set(held) and len(held) == len(set(held))  # every page the step reads, each in one slot
        assert all(int(cache.slot_of[p]) == s for s, p in enumerate(cache.held.tolist()) if p >= 0)
        assert int((cache.slot_of >= 0).sum()) == len(held)
        if num_pages >= host_kv.shape[0]:  # every page fits: only first reads miss, whichever row reads them
            assert int(resolution.misses) == len(pages - seen)
        seen |= pages


def test_a_page_freed_and_written_by_the_next_request_is_read_as_written():
    """Request 1 finishes and its pages go to a new request, whose prefill writes them: the writes go to the host
    pages and, through PageCache.device_slots, to their device copies, so the new request's first decode step
    (hits on those very pages) reads its own K/V, not the old request's."""
    (case, batch, q, selected), *_ = decode_steps(1, seed=7)
    host_kv = case.kv_cache
    cache, device_kv = device_tier(host_kv, 48)
    attend_through(cache, device_kv, host_kv, batch, q, selected, case.scale)
    g = torch.Generator().manual_seed(8)
    new_len = 190  # in the finished request's 13 pages (it had 201 tokens)
    pages = case.batch.block_table[1, : -(-new_len // SHAPE.block_size)].long()
    slots = (pages[:, None] * SHAPE.block_size + torch.arange(SHAPE.block_size)).flatten()[:new_len]
    rows = torch.randn(new_len, 2, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g, dtype=torch.float64)
    write_rows(host_kv, slots, rows)
    device_slots = cache.device_slots(slots, SHAPE.block_size)
    assert int((device_slots >= 0).sum()) > 0  # some of the new request's pages are held from the step before
    write_rows(device_kv, device_slots, rows)
    seq_lens = case.batch.seq_lens.clone()
    seq_lens[1] = new_len
    new_batch = PagedBatch(case.batch.query_start_loc, seq_lens, case.batch.block_table, "decode")
    q = torch.randn(case.q.shape, generator=g, dtype=torch.float64)
    scores = reference.index_block_scores(case.index_q, case.index_key_cache, new_batch, SHAPE)
    selected = reference.topk_blocks(scores, new_batch.positions, SHAPE)
    through, resolution = attend_through(cache, device_kv, host_kv, new_batch, q, selected, case.scale)
    assert int(resolution.hits) > 0
    assert torch.equal(through, reference.sparse_attention(q, host_kv, new_batch, selected, SHAPE, case.scale))


def test_device_slots_are_the_written_rows_in_the_copies_of_held_pages():
    cache = PageCache.empty(4, 10, first_page=20)
    table = torch.tensor([[3, 7, 1]], dtype=torch.int32)
    resolve(cache, torch.tensor([[0, 2, -1]], dtype=torch.int32), table)  # host pages 3 and 1 held
    block = 16
    slots = torch.tensor([3 * block + 5, 7 * block, 1 * block + 15, -1, 1 * block])
    device_page = {p: int(cache.pages[int(cache.slot_of[p])]) for p in (3, 1)}
    want = [device_page[3] * block + 5, -1, device_page[1] * block + 15, -1, device_page[1] * block]
    assert cache.device_slots(slots, block).tolist() == want


class Clock:
    """The policy resolve implements, slot by slot in Python (CLOCK): a read sets its slot's reference bit; each
    missing page (ascending) takes the slot the hand reaches first that the step does not read and whose bit is
    clear, the hand clearing the bits it passes; a filled slot is referenced."""

    def __init__(self, num_pages: int):
        self.held, self.referenced, self.hand = [-1] * num_pages, [False] * num_pages, 0

    def step(self, wanted: list[int]) -> tuple[int, int]:
        """(hits, misses) of a step reading the host pages `wanted`."""
        read = {self.held.index(p) for p in wanted if p in self.held}
        hits = len(read)
        for slot in read:
            self.referenced[slot] = True
        for page in sorted(p for p in wanted if p not in self.held):
            while True:
                slot, self.hand = self.hand, (self.hand + 1) % len(self.held)
                if slot in read:
                    continue
                if self.referenced[slot]:
                    self.referenced[slot] = False
                    continue
                break
            self.held[slot], self.referenced[slot] = page, True
            read.add(slot)
        return hits, len(wanted) - hits


def test_the_device_tier_keeps_the_clock_policy():
    rng = random.Random(3)
    width, num_requests, num_pages = 4, 3, 14
    # Request r's block b on host page 10 r + b; requests 1 and 2 share their block 0 (a shared prefix's page).
    table = torch.arange(10, dtype=torch.int32)[None] + 10 * torch.arange(num_requests, dtype=torch.int32)[:, None]
    table[2, 0] = table[1, 0]
    cache, clock = PageCache.empty(num_pages, 10 * num_requests), Clock(num_pages)
    counts = []
    for _ in range(200):
        rows = [sorted(rng.sample(range(10), rng.randint(1, width))) for _ in range(num_requests)]
        blocks = torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int32)
        resolution = resolve(cache, blocks, table)
        counts.append(clock.step(sorted({int(table[r, b]) for r, row in enumerate(rows) for b in row})))
        assert (int(resolution.hits), int(resolution.misses)) == counts[-1]
        assert cache.held.tolist() == clock.held and cache.referenced.tolist() == clock.referenced
        assert int(cache.hand) == clock.hand
    assert sum(h for h, _ in counts) > 0 and sum(m for _, m in counts[10:]) > 0  # both kinds, after the tier filled


class HostReads(TorchDispatchMode):
    """The ops dispatched inside the block that read a tensor's values back to the host (on a GPU: a sync, which a
    CUDA graph cannot capture): .item() and tensors indexed by a tensor of one value, nonzero, masks as indices."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique")

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        masks = name.startswith("aten.index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
        )
        if name.startswith(self.SYNCING) or masks:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def test_a_step_of_the_tier_reads_nothing_back_to_the_host():
    """step_blocks, resolve and device_slots as a decode step runs them, evictions included: no op that syncs a GPU's
    host (the served tier replays them in full CUDA graphs)."""
    generator = torch.Generator().manual_seed(5)
    cache = PageCache.empty(16, 40)
    table = torch.arange(40, dtype=torch.int32).view(2, 20)
    for _ in range(6):
        selected = torch.randint(-1, 20, (2, 4, 2), dtype=torch.int32, generator=generator)
        with HostReads() as reads:
            resolve(cache, step_blocks(selected), table)
            cache.device_slots(torch.tensor([5, 40, -1]), 4)
        assert reads.found == []


def test_a_device_tier_smaller_than_a_steps_blocks_is_refused():
    with pytest.raises(ValueError, match="cannot hold a step's 2 x 8 blocks"):
        resolve(PageCache.empty(15, 4), torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32))


def test_the_host_tier_benchmark_misses_what_it_says_on_cpu(capsys):
    """bench/bench_host_tier.py's set-up: every call of its rotation misses exactly --misses pages a request (it
    asserts the tier's own counts), so its GPU table times what it names."""
    from bench import bench_host_tier

    bench_host_tier.main(["--device", "cpu", "--contexts", "28672", "--batches", "1", "3", "--misses", "0", "5", "16"])
    assert capsys.readouterr().out.count("the tier's counts check out") == 6
