"""MSA written as the spec reads, one token and one head at a time: the oracle for msa_kernels.reference.

Slow on purpose; only for small shapes in tests. float64 throughout.
"""

import math

import torch

from msa_kernels.shapes import MSAShape


def naive_msa(q, index_q, keys, values, index_keys, q_positions, shape: MSAShape, scale: float):
    """One request with contiguous caches.

    q [T, Hq, D], index_q [T, Hi, Dp], keys/values [N, Hkv, D], index_keys [N, Hki, Dp],
    q_positions: list of T positions. Returns (out [T, Hq, D], selected: list[T][Hi] of sorted block lists).
    """
    bs = shape.block_size
    out = torch.zeros(q.shape, dtype=torch.float64)
    selected = []
    for t, pos in enumerate(q_positions):
        per_head = []
        for h in range(shape.num_index_heads):
            kh = h // shape.index_heads_per_key_head
            block_score = {}
            for j in range(pos + 1):
                s = float(index_q[t, h].double() @ index_keys[j, kh].double())
                block_score[j // bs] = max(block_score.get(j // bs, -math.inf), s)
            qb = pos // bs
            forced = {b for b in block_score if b > qb - shape.local_blocks or b < shape.init_blocks}
            rest = sorted((b for b in block_score if b not in forced), key=lambda b: -block_score[b])
            chosen = sorted(forced | set(rest[: shape.topk_blocks - len(forced)]))
            per_head.append(chosen)
        selected.append(per_head)
        for g in range(shape.num_q_heads):
            h = g // shape.heads_per_index_head
            kv = g // (shape.num_q_heads // shape.num_kv_heads)
            js = [j for j in range(pos + 1) if j // bs in per_head[h]]
            s = torch.stack([q[t, g].double() @ keys[j, kv].double() for j in js]) * scale
            p = torch.softmax(s, dim=0)
            out[t, g] = sum(p[i] * values[j, kv].double() for i, j in enumerate(js))
    return out, selected
