"""The K/V host tier's step (msa_kernels.host_tier) on CPU: the sparse attention through a request's hot set reads
exactly what it reads from the whole cache, and the hot sets keep the blocks a least-recently-used policy keeps."""

import random

import pytest
import torch

from msa_kernels import reference
from msa_kernels.host_tier import HotSets, copy_pages, resolve, step_blocks
from msa_kernels.shapes import PagedBatch
from msa_kernels.testing import make_case, small_shape

SHAPE = small_shape(topk_blocks=4, local_blocks=2, init_blocks=1)  # 16-token blocks, Hi 2: a step reads <= 8 blocks
# Contexts off the block grid, one shorter than K blocks, one of many blocks.
SEQ_LENS = [37, 201, 64, 530]


def test_step_blocks_is_each_requests_union_of_its_index_heads_blocks():
    g = torch.Generator().manual_seed(1)
    selected = torch.randint(-1, 9, (5, 3, 4), generator=g, dtype=torch.int32)
    blocks = step_blocks(selected)
    assert blocks.shape == (5, 12) and blocks.dtype == torch.int32
    for row, want in zip(blocks.tolist(), selected.flatten(1).tolist()):
        union = sorted({b for b in want if b >= 0})
        assert row == union + [-1] * (12 - len(union))


def decode_steps(num_steps: int, seed: int):
    """A decode batch (one query token per request at SEQ_LENS; free pages and page tails NaN) and, per step, fresh
    queries and the reference's selection for them: each step selects other blocks, as consecutive decode steps
    do."""
    case = make_case(SHAPE, [1] * len(SEQ_LENS), SEQ_LENS, dtype=torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(num_steps):
        index_q = torch.randn(case.index_q.shape, generator=g, dtype=torch.float64)
        q = torch.randn(case.q.shape, generator=g, dtype=torch.float64)
        scores = reference.index_block_scores(index_q, case.index_key_cache, case.batch, SHAPE)
        yield case, q, reference.topk_blocks(scores, case.batch.positions, SHAPE)


@pytest.mark.parametrize("spilled", ["every block", "half the blocks"])
@pytest.mark.parametrize("capacity", [8, 13, 40])  # the least a step needs (Hi x K), more, the whole context
def test_attention_through_the_hot_sets_equals_attention_on_the_whole_cache(capacity, spilled):
    num_requests = len(SEQ_LENS)
    steps = list(decode_steps(12, seed=capacity))
    case = steps[0][0]
    host_kv, table = case.kv_cache, case.batch.block_table  # every block's K/V at home in host memory
    # The device: the pages still resident, the spilled ones NaN, then the hot sets' pages, NaN until copied in.
    spill = torch.ones(table.shape, dtype=torch.bool)
    resident_table = None
    if spilled == "half the blocks":
        spill = torch.rand(table.shape, generator=torch.Generator().manual_seed(capacity)) < 0.5
        resident_table = table.masked_fill(spill, -1)
    device_kv = torch.cat([host_kv, torch.full((num_requests * capacity, *host_kv.shape[1:]), float("nan"))])
    num_blocks = -(-torch.tensor(SEQ_LENS) // SHAPE.block_size)
    owned = torch.arange(table.shape[1])[None, :] < num_blocks[:, None]
    device_kv[table[spill & owned].long()] = float("nan")  # (past a request's blocks its table holds page 0)
    hot_sets = HotSets.empty(num_requests, capacity, first_page=host_kv.shape[0])
    seen: list[set[int]] = [set() for _ in SEQ_LENS]
    for step, (_, q, selected) in enumerate(steps):
        blocks = step_blocks(selected)
        before = hot_sets.blocks.clone()
        resolution = resolve(hot_sets, blocks, table, step, resident_table)
        copy_pages(host_kv, device_kv, resolution)
        hot_batch = PagedBatch(case.batch.query_start_loc, case.batch.seq_lens, resolution.block_table, "decode")
        through_hot = reference.sparse_attention(q, device_kv, hot_batch, selected, SHAPE, case.scale)
        whole = reference.sparse_attention(q, host_kv, case.batch, selected, SHAPE, case.scale)
        assert torch.equal(through_hot, whole), f"step {step}"
        for r, row in enumerate(blocks.tolist()):
            step_set = {b for b in row if b >= 0}
            spilled_set = {b for b in step_set if spill[r, b]}
            held_before = set(before[r].tolist())
            assert resolution.resident[r] == len(step_set - spilled_set)
            assert resolution.hits[r] == len(spilled_set & held_before)
            assert resolution.misses[r] == len(spilled_set - held_before)
            assert spilled_set <= set(hot_sets.blocks[r].tolist())  # every spilled block the step reads is held
            held = [b for b in hot_sets.blocks[r].tolist() if b >= 0]
            assert len(held) == len(set(held)) and not set(held) - {b for b in range(table.shape[1]) if spill[r, b]}
            if capacity * SHAPE.block_size >= SEQ_LENS[r]:  # the whole context fits: only first reads miss
                assert resolution.misses[r] == len(spilled_set - seen[r])
            seen[r] |= spilled_set


def lru_slots(steps: list[list[int]], capacity: int) -> list[tuple[int, int]]:
    """(hits, misses) per step of one request's hot set under the policy resolve implements, slot by slot in Python:
    a miss takes the slot not read this step whose last read is oldest (never read first), the lowest slot on a tie."""
    blocks, last = [-1] * capacity, [-1] * capacity
    counts = []
    for step, wanted in enumerate(steps):
        read = {blocks.index(b) for b in wanted if b in blocks}
        hits = len(read)
        free = sorted((s for s in range(capacity) if s not in read), key=lambda s: (last[s], s))
        for b in (b for b in wanted if b not in blocks):
            slot = free.pop(0)
            blocks[slot] = b
            read.add(slot)
        for s in read:
            last[s] = step
        counts.append((hits, len(wanted) - hits))
    return counts


def test_hot_sets_keep_the_least_recently_used_policy():
    rng = random.Random(3)
    capacity, width, num_requests = 6, 4, 3
    steps = [[sorted(rng.sample(range(10), rng.randint(1, width))) for _ in range(40)] for _ in range(num_requests)]
    hot_sets = HotSets.empty(num_requests, capacity)
    table = torch.arange(10, dtype=torch.int32).repeat(num_requests, 1)
    got: list[list[tuple[int, int]]] = [[] for _ in range(num_requests)]
    for step in range(40):
        rows = [steps[r][step] + [-1] * (width - len(steps[r][step])) for r in range(num_requests)]
        resolution = resolve(hot_sets, torch.tensor(rows, dtype=torch.int32), table, step)
        for r in range(num_requests):
            got[r].append((int(resolution.hits[r]), int(resolution.misses[r])))
    assert got == [lru_slots(steps[r], capacity) for r in range(num_requests)]


def test_a_hot_set_smaller_than_a_steps_blocks_is_refused():
    with pytest.raises(ValueError, match="cannot hold a step's 8 blocks"):
        resolve(HotSets.empty(1, 7), torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32), 0)
