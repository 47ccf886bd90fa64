"""FLASH_MSA's dense path (FlashMSAImpl.forward): the plain attention layers of a model served with
--attention-backend FLASH_MSA (a checkpoint's dense_layers, MiniMax-M3's first layers).

On CPU it is the sparse attention path with every block selected; on a Hopper GPU vLLM's
FlashAttention 3 on FLASH_MSA's paged K/V cache, also replayed from a CUDA graph captured on
shorter contexts (as vLLM's full decode graphs are). Checked against dense causal attention in
float64 on fresh random inputs, outputs NaN-poisoned first.
"""

import pytest
import torch

from msa_kernels.shapes import MSAShape, PagedBatch
from msa_kernels.testing import make_case
from vllm_msa.backend import FlashMSAImpl, FlashMSAMetadata, dense_flash_attn_version

# (q_lens, seq_lens): decode, prefill, chunked prefill, ragged mix (contexts off the 128 grid)
BATCHES = {
    "decode": ([1, 1, 1], [1, 300, 5000]),
    "prefill": ([700], [700]),
    "chunked_prefill": ([256], [3000]),
    "ragged": ([1, 129, 40], [4097, 129, 1000]),
}


def _metadata(batch: PagedBatch, num_splits: int = 0) -> FlashMSAMetadata:
    return FlashMSAMetadata(
        batch=batch,
        slot_mapping=torch.empty(0),
        num_actual_tokens=batch.num_tokens,
        max_query_len=max(batch.query_lens_cpu),
        max_seq_len=max(batch.seq_lens_cpu),
        dense_num_splits=num_splits,
    )


def _want(case) -> torch.Tensor:
    """Dense causal attention of every request (msa_kernels.testing), float64."""
    return torch.cat([case.dense_causal(r) for r in range(case.batch.num_requests)])


def _assert_close(got: torch.Tensor, want: torch.Tensor, cos_min: float, rel_max: float) -> None:
    assert torch.isfinite(got).all()
    got = got.double()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    rel = ((got - want).norm() / want.norm()).item()
    assert cos >= cos_min and rel <= rel_max, (cos, rel)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_name", BATCHES)
def test_dense_path_is_dense_causal_attention(device, batch_name):
    shape = MSAShape(
        num_q_heads=16,
        num_kv_heads=2,
        head_dim=128,
        num_index_heads=2,
        num_index_key_heads=1,
        index_head_dim=8,
        topk_blocks=1,
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q_lens, seq_lens = BATCHES[batch_name]
    case = make_case(shape, q_lens, seq_lens, dtype=dtype, device=device, seed=len(batch_name) * 31 + len(q_lens))
    # Stale slots hold finite garbage, as in vLLM's (zero-initialised) caches: FlashAttention reads the
    # masked tail of a request's last page, and 0 * NaN there would be NaN.
    case.kv_cache.nan_to_num_(nan=1e3)
    impl = FlashMSAImpl(shape.num_q_heads, shape.head_dim, case.scale, shape.num_kv_heads)
    if device == "cuda":
        assert dense_flash_attn_version(case.q.device, dtype, shape.head_dim) == 3, "Hopper runs FA3"
    out = torch.full_like(case.q, float("nan"))
    impl.forward(None, case.q, None, None, case.kv_cache.flatten(-2), _metadata(case.batch), out)
    bf16 = dtype == torch.bfloat16
    _assert_close(out, _want(case), 0.99 if bf16 else 0.999999, 1e-2 if bf16 else 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_path_replayed_from_a_cuda_graph_on_longer_contexts_matches():
    """Capture a decode step on short contexts with vLLM's split bound for graphs, replay it on up
    to 128K-token contexts and a padded batch (seq_len 0, no tokens), as vLLM's full graphs do."""
    shape = MSAShape(
        num_q_heads=64,
        num_kv_heads=4,
        head_dim=128,
        num_index_heads=4,
        num_index_key_heads=1,
        index_head_dim=8,
        topk_blocks=1,
    )
    seq_lens = [131072, 700, 9000]
    case = make_case(shape, [1] * len(seq_lens), seq_lens, dtype=torch.bfloat16, device="cuda", seed=5)
    padded, n = 4, len(seq_lens)
    qsl = torch.arange(padded + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((padded,), 130, dtype=torch.int32, device="cuda")
    table = case.batch.block_table[:1].repeat(padded, 1).contiguous()
    q = torch.randn(padded, *case.q.shape[1:], device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    batch = PagedBatch(query_start_loc=qsl, seq_lens=lens, block_table=table)
    metadata = FlashMSAMetadata(
        batch=batch,
        slot_mapping=torch.empty(0),
        num_actual_tokens=padded,
        max_query_len=1,
        max_seq_len=130,
        dense_num_splits=32,
    )
    impl = FlashMSAImpl(shape.num_q_heads, shape.head_dim, case.scale, shape.num_kv_heads)
    impl.forward(None, q, None, None, case.kv_cache.flatten(-2), metadata, out)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, q, None, None, case.kv_cache.flatten(-2), metadata, out)
    qsl[n + 1 :] = n
    lens.copy_(torch.tensor(seq_lens + [0] * (padded - n), dtype=torch.int32))
    table.zero_()
    table[:n] = case.batch.block_table
    q[:n] = case.q
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out[:n], _want(case), 0.99, 1e-2)
