"""What a step's top-k selections add to the served metrics' running totals (vllm_msa/metrics.py), by their
definition in PyTorch: the CPU path and the reference of the CuTeDSL kernel (msa_kernels/cute/selection_stats.py).

A selection is one query token's blocks for one index head, selected [T, Hi, K] (-1 = none), the token at
positions[t] (-1: a CUDA graph's padding token, which counts nothing). For each real selection:

    selections         1
    decode_selections  1 if the token is one of the step's first decode_tokens (its decode part)
    selected_blocks    its blocks (>= 0)
    context_tokens     the tokens it can see: position + 1
    read_tokens        the context tokens its blocks hold: blocks x block_size less the tokens of its own block
                       after it (block_size - 1 - position % block_size; its own block is always selected)
    read_fraction      read_tokens / context_tokens, as a histogram: its sum, and a count per bucket (the first
                       bound it does not exceed, READ_FRACTION_BUCKETS, then +Inf)

each times `layers` (the MSA layers of the step, which select as many blocks: the last one's selection stands for
all). The totals are float64 (exact for integer counts up to 2**53).
"""

import functools

import torch

READ_FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
SELECTION_COUNTERS = ("selections", "decode_selections", "selected_blocks", "context_tokens", "read_tokens")
READ_FRACTION_FIELDS = (
    "read_fraction_sum",
    *(f"read_fraction_le_{bound}" for bound in READ_FRACTION_BUCKETS),
    "read_fraction_inf",
)
SELECTION_FIELDS = (*SELECTION_COUNTERS, *READ_FRACTION_FIELDS)  # the totals' order


def add_selection_stats(
    totals: torch.Tensor,
    selected: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    decode_tokens: int,
    layers: int,
) -> None:
    """Add the selections' counts (module docstring) to totals [len(SELECTION_FIELDS)] float64, on the selection's
    device, without a host sync. positions: [>= T] int32 or int64."""
    num_tokens, num_heads, _ = selected.shape
    if num_tokens == 0:
        return
    pos = positions[:num_tokens]
    real = (pos >= 0)[:, None].expand(num_tokens, num_heads)
    blocks = (selected >= 0).sum(-1)  # [T, Hi]
    context = (pos + 1)[:, None].expand(num_tokens, num_heads)
    own_block_unseen = block_size - 1 - pos % block_size
    read = (blocks * block_size - own_block_unseen[:, None]).where(real, 0)
    fraction = (read.double() / context.clamp(min=1)).flatten()
    sums = torch.stack(
        [real.sum(), real[:decode_tokens].sum(), blocks.where(real, 0).sum(), context.where(real, 0).sum(), read.sum()]
    )
    counters = len(SELECTION_COUNTERS)
    totals[:counters] += sums.double() * layers
    totals[counters] += fraction.sum() * layers
    buckets = torch.bucketize(fraction, _bounds(totals.device))
    totals[counters + 1 :].index_add_(0, buckets, real.flatten().double() * layers)


@functools.cache
def _bounds(device: torch.device) -> torch.Tensor:
    """READ_FRACTION_BUCKETS on the device, made once (a copy to a GPU in every step would sync it)."""
    return torch.tensor(READ_FRACTION_BUCKETS, dtype=torch.float64, device=device)
