"""FLASH_MSA's dense path (FlashMSAImpl.forward): the plain attention layers of a model served with
--attention-backend FLASH_MSA (a checkpoint's dense_layers, MiniMax-M3's first layers).

On CPU it is the sparse attention path with every block selected; on a Hopper GPU vLLM's
FlashAttention 3 on FLASH_MSA's paged K/V cache, also replayed from a CUDA graph captured on
shorter contexts (as vLLM's full decode graphs are). Checked against dense causal attention in
float64 on fresh random inputs, outputs NaN-poisoned first; on an FP8 K/V cache against the same
attention over the dequantised pages (and, where FlashAttention 3 reads them, e4m3-rounded queries).
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from msa_kernels import reference
from msa_kernels.fp8_index_keys import E4M3_MAX
from msa_kernels.plan import StepPlan
from msa_kernels.shapes import MSAShape, PagedBatch
from msa_kernels.testing import PagedCase, bound_kv_cache, make_case
from vllm_msa.backend import FlashMSAImpl, FlashMSAMetadata, dense_flash_attn_version, write_paged

# (q_lens, seq_lens): decode, prefill, chunked prefill, ragged mix (contexts off the 128 grid)
BATCHES = {
    "decode": ([1, 1, 1], [1, 300, 5000]),
    "prefill": ([700], [700]),
    "chunked_prefill": ([256], [3000]),
    "ragged": ([1, 129, 40], [4097, 129, 1000]),
}


def _metadata(batch: PagedBatch, num_splits: int = 0) -> FlashMSAMetadata:
    return FlashMSAMetadata(
        plan=StepPlan.of(batch),
        slot_mapping=torch.empty(0),
        num_actual_tokens=batch.num_tokens,
        max_query_len=max(batch.query_lens_cpu),
        max_seq_len=max(batch.seq_lens_cpu),
        dense_num_splits=num_splits,
    )


def _want(case: PagedCase) -> torch.Tensor:
    """Dense causal attention of every request (msa_kernels.testing), float64."""
    return torch.cat([case.dense_causal(r) for r in range(case.batch.num_requests)])


FA3_FP8_REL_ERR = 5e-2  # FlashAttention 3 on e4m3 Q, K, V and probabilities (the FP8 test says why)

# A vLLM attention layer's FP8 scales (vLLM's Attention holds them as these attributes; powers of two, so that
# dividing by them and multiplying by their inverse round alike)
FP8_LAYER = SimpleNamespace(
    _q_scale=torch.tensor(0.5),
    _k_scale=torch.tensor(2.0),
    _v_scale=torch.tensor(0.25),
    _k_scale_float=2.0,
    _v_scale_float=0.25,
)


def _fp8_layer(device) -> SimpleNamespace:
    return SimpleNamespace(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in vars(FP8_LAYER).items()})


def _fp8_want(case: PagedCase, fp8_cache: torch.Tensor, e4m3_queries: bool) -> torch.Tensor:
    """_want over the dequantised FP8 pages; with e4m3_queries, of the queries as FlashAttention 3 reads them
    (static e4m3 quantisation by q_scale)."""
    scales = torch.tensor([FP8_LAYER._k_scale_float, FP8_LAYER._v_scale_float], device=fp8_cache.device)
    dequantised = fp8_cache.view(torch.float8_e4m3fn).double() * scales.double().view(1, 2, 1, 1, 1)
    q = case.q.double()
    if e4m3_queries:
        q_scale = FP8_LAYER._q_scale.item()
        q = (q / q_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() * q_scale
    return _want(replace(case, q=q, kv_cache=dequantised))


def _assert_close(got: torch.Tensor, want: torch.Tensor, cos_min: float, rel_max: float) -> None:
    assert torch.isfinite(got).all()
    got = got.double()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    rel = ((got - want).norm() / want.norm()).item()
    assert cos >= cos_min and rel <= rel_max, (cos, rel)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


DENSE_SHAPE = MSAShape(
    num_q_heads=16,
    num_kv_heads=2,
    head_dim=128,
    num_index_heads=2,
    num_index_key_heads=1,
    index_head_dim=8,
    topk_blocks=1,
)


def _dense_case(device: str, batch_name: str, fp8_kv: bool) -> PagedCase:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q_lens, seq_lens = BATCHES[batch_name]
    seed = len(batch_name) * 31 + len(q_lens) + fp8_kv
    case = make_case(DENSE_SHAPE, q_lens, seq_lens, dtype=dtype, device=device, seed=seed)
    # Stale slots hold finite garbage, as in vLLM's (zero-initialised) caches: FlashAttention reads the
    # masked tail of a request's last page, and 0 * NaN there would be NaN.
    case.kv_cache.nan_to_num_(nan=1e3)
    return case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_name", BATCHES)
def test_dense_path_is_dense_causal_attention(device, batch_name):
    case = _dense_case(device, batch_name, fp8_kv=False)
    impl = FlashMSAImpl(DENSE_SHAPE.num_q_heads, DENSE_SHAPE.head_dim, case.scale, DENSE_SHAPE.num_kv_heads)
    if device == "cuda":
        assert dense_flash_attn_version(case.q.device, case.q.dtype, DENSE_SHAPE.head_dim) == 3, "Hopper runs FA3"
    out = torch.full_like(case.q, float("nan"))
    impl.forward(None, case.q, None, None, bound_kv_cache(case.kv_cache), _metadata(case.batch), out)
    bf16 = case.q.dtype == torch.bfloat16
    _assert_close(out, _want(case), 0.99 if bf16 else 0.999999, 1e-2 if bf16 else 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_name", BATCHES)
def test_dense_path_on_an_fp8_kv_cache_is_dense_attention_over_its_dequantised_pages(device, batch_name):
    """--kv-cache-dtype fp8: on CPU the sparse path over every block dequantises the pages (float32, tight); on
    Hopper FlashAttention 3 reads them with e4m3 queries and descales. Its second matmul also takes the
    softmax probabilities in e4m3 (exp2(s - max + 8), rounded): about 2.5% relative RMS error in the output,
    which does not shrink with the context (the output and its error are both sums over the keys), so the
    bound there is 5e-2 (a float64 model of FA3's rounding on these inputs: 0.002-0.025) with cosine 0.999."""
    case = _dense_case(device, batch_name, fp8_kv=True)
    layer = _fp8_layer(device)
    fp8_cache = reference.fp8_kv_cache(case.kv_cache, (FP8_LAYER._k_scale_float, FP8_LAYER._v_scale_float))
    impl = FlashMSAImpl(
        DENSE_SHAPE.num_q_heads, DENSE_SHAPE.head_dim, case.scale, DENSE_SHAPE.num_kv_heads, None, None, "fp8"
    )
    flash_attn = dense_flash_attn_version(case.q.device, case.q.dtype, DENSE_SHAPE.head_dim, fp8_kv=True)
    assert flash_attn == (3 if device == "cuda" else None), "Hopper's FA3 reads FP8 pages"
    out = torch.full_like(case.q, float("nan"))
    impl.forward(layer, case.q, None, None, bound_kv_cache(fp8_cache), _metadata(case.batch), out)
    want = _fp8_want(case, fp8_cache, e4m3_queries=flash_attn is not None)
    _assert_close(out, want, 0.999 if device == "cuda" else 0.999999, FA3_FP8_REL_ERR if device == "cuda" else 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_kv_pages_written_on_cuda_hold_the_reference_bytes():
    """write_paged on CUDA (vLLM's reshape_and_cache_flash with the layer's scale tensors) against the
    reference's e4m3 of K / k_scale and V / v_scale, byte for byte; slots < 0 skipped, NaN kept (as a NaN:
    vLLM's kernel writes 0x7f where torch's CPU cast writes 0xff, both e4m3 NaN)."""
    rows, heads, dim, pages, block = 300, 2, 128, 6, 128
    g = torch.Generator().manual_seed(11)
    key, value = (torch.randn(rows, heads, dim, generator=g) * 200 for _ in range(2))  # some saturate at 448
    key[3, 0, 5] = float("nan")
    slots = torch.randperm(pages * block, generator=g)[:rows]
    slots[::7] = -1
    caches = {}
    for device in ("cpu", "cuda"):
        cache = torch.zeros(pages, 2, block, heads, dim, dtype=reference.FP8_KV_STORAGE, device=device)
        bf16 = (key.bfloat16().to(device), value.bfloat16().to(device))
        write_paged(cache[:, 0], cache[:, 1], slots.to(device), *bf16, _fp8_layer(device))
        caches[device] = cache.cpu()
    nan = {device: cache.view(torch.float8_e4m3fn).float().isnan() for device, cache in caches.items()}
    assert torch.equal(nan["cuda"], nan["cpu"]) and nan["cpu"].sum() == 1
    assert torch.equal(caches["cuda"][~nan["cuda"]], caches["cpu"][~nan["cpu"]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8_kv", [False, True], ids=["bf16_kv", "fp8_kv"])
def test_dense_path_replayed_from_a_cuda_graph_on_longer_contexts_matches(fp8_kv):
    """Capture a decode step on short contexts with vLLM's split bound for graphs, replay it on up
    to 128K-token contexts and a padded batch (seq_len 0, no tokens), as vLLM's full graphs do; on a bf16
    and on an FP8 K/V cache (the query quantisation recorded too)."""
    shape = replace(DENSE_SHAPE, num_q_heads=64, num_kv_heads=4, num_index_heads=4)  # M3's heads
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
        plan=StepPlan.of(batch),
        slot_mapping=torch.empty(0),
        num_actual_tokens=padded,
        max_query_len=1,
        max_seq_len=130,
        dense_num_splits=32,
    )
    kv_cache, layer = case.kv_cache, None
    if fp8_kv:
        case.kv_cache.nan_to_num_(nan=1e3)  # finite stale slots, as in vLLM's caches (the FP8 test's reason)
        kv_cache = reference.fp8_kv_cache(case.kv_cache, (FP8_LAYER._k_scale_float, FP8_LAYER._v_scale_float))
        layer = _fp8_layer("cuda")
    impl = FlashMSAImpl(
        shape.num_q_heads, shape.head_dim, case.scale, shape.num_kv_heads, None, None, "fp8" if fp8_kv else "auto"
    )
    assert impl.graph_capturable(q.device, q.dtype)
    impl.forward(layer, q, None, None, bound_kv_cache(kv_cache), metadata, out)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(layer, q, None, None, bound_kv_cache(kv_cache), metadata, out)
    qsl[n + 1 :] = n
    lens.copy_(torch.tensor(seq_lens + [0] * (padded - n), dtype=torch.int32))
    table.zero_()
    table[:n] = case.batch.block_table
    q[:n] = case.q
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = _fp8_want(case, kv_cache, e4m3_queries=True) if fp8_kv else _want(case)
    _assert_close(out[:n], want, 0.999 if fp8_kv else 0.99, FA3_FP8_REL_ERR if fp8_kv else 1e-2)
