"""Smoke test of the staged vLLM (0.34.0, with torch 2.14.0 and its NCCL) on the GPU machine (after
`source dev/gpu/install_vllm.sh`).

    python3 dev/gpu/check_vllm.py

Checks, each timed and reported PASS/WARN/FAIL: torch is the staged one (not the image's); vllm imports
and its version; the CUDA extensions
(vllm._C_stable_libtorch, _moe_C_stable_libtorch) load and are the CUDA 13 build; the FLASH_ATTN
backend imports and picks FA3 on this GPU; a small paged FA3 attention call matches PyTorch, also when
replayed from a CUDA graph; the MiniMax-M3 sparse ops import (common/ops: Triton; nvidia/ops:
CuTeDSL + quack) and the Triton sparse decode kernel matches PyTorch; flashinfer and CuTeDSL import;
vLLM's requirements are met by what is installed. Exit status 1 if any check FAILs.
"""

import importlib
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

results = []


def check(name, fatal=False):
    def wrap(fn):
        t = time.perf_counter()
        try:
            msg = fn()
            status = "WARN" if isinstance(msg, str) and msg.startswith("WARN") else "PASS"
        except Exception as e:  # report every failure and go on
            status, msg = "FAIL", f"{type(e).__name__}: {e}"
            if os.environ.get("CHECK_VLLM_TRACEBACK"):
                traceback.print_exc()
        dt = time.perf_counter() - t
        results.append((name, status))
        print(f"[{status}] {name} ({dt:.2f} s){': ' + msg if msg else ''}", flush=True)
        if fatal and status == "FAIL":
            summary()
        return fn

    return wrap


def summary():
    bad = [n for n, s in results if s == "FAIL"]
    warn = [n for n, s in results if s == "WARN"]
    print(
        f"check_vllm: {len(results) - len(bad) - len(warn)} passed, {len(bad)} failed, {len(warn)} warned"
        + (f"; failed: {', '.join(bad)}" if bad else ""),
        flush=True,
    )
    sys.exit(1 if bad else 0)


import torch  # noqa: E402

# The repository's timing helper by its path: this runs right after the kit's install, before the plugin (and its
# msa_kernels package) is installed.
_timing_spec = importlib.util.spec_from_file_location(
    "msa_timing", Path(__file__).resolve().parents[2] / "bench" / "timing.py"
)
_timing = importlib.util.module_from_spec(_timing_spec)
_timing_spec.loader.exec_module(_timing)
timed = _timing.timed

print(
    f"python {sys.version.split()[0]} at {sys.executable}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
    f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}",
    flush=True,
)
if not torch.cuda.is_available():
    print("[FAIL] no CUDA device visible to torch")
    sys.exit(1)
cap = torch.cuda.get_device_capability()
print(f"GPU: {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}", flush=True)
dev = torch.device("cuda")


@check("import vllm", fatal=True)
def _():
    import vllm

    where = os.path.dirname(vllm.__file__)
    assert vllm.__version__.startswith("0.34."), f"version {vllm.__version__}"
    assert torch.__version__.startswith("2.14.0"), (
        f"torch {torch.__version__} from {torch.__file__}: not the staged 2.14.0"
    )
    return f"vllm {vllm.__version__} from {where}"


@check("vllm CUDA extensions (_C_stable_libtorch, _moe_C_stable_libtorch)", fatal=True)
def _():
    import vllm._C_stable_libtorch
    import vllm._moe_C_stable_libtorch
    from vllm.platforms import current_platform

    assert current_platform.is_cuda(), f"vLLM picked platform {current_platform.__class__.__name__}"
    so = Path(vllm._C_stable_libtorch.__file__).read_bytes()
    assert b"libcudart.so.13" in so, "does not link libcudart.so.13"
    assert hasattr(torch.ops._C, "rotary_embedding"), "torch.ops._C.rotary_embedding is not registered"
    return f"platform {current_platform.__class__.__name__}, torch.ops._C registered, links libcudart.so.13"


@check("FLASH_ATTN backend and FlashAttention version", fatal=True)
def _():
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.vllm_flash_attn import flash_attn_interface as fai

    cls = AttentionBackendEnum.FLASH_ATTN.get_class()
    v = get_flash_attn_version()
    note = (
        f"{cls.__name__}; FA{v} chosen; FA2 {'present' if fai.FA2_AVAILABLE else 'absent (dropped by stage_vllm.sh)'}"
    )
    if cap[0] == 9:
        assert fai.FA3_AVAILABLE, f"FA3 unavailable: {fai.FA3_UNAVAILABLE_REASON}"
        assert v == 3, f"expected FA3 on sm_90, got FA{v}"
    return note


def ref_attention(q, k, v, scale):  # q [Lq, H, D], k/v [Lk, Hkv, D]; causal, bottom-right aligned
    h, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hkv, dim=1).float()
    v = v.repeat_interleave(h // hkv, dim=1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk, device=q.device)[None, :] > (torch.arange(lq, device=q.device)[:, None] + lk - lq)
    s.masked_fill_(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@check("FA3 paged attention (2 sequences, bf16, block 128, GQA 32/8, D=128) vs PyTorch, eager and CUDA graph")
def _():
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    torch.manual_seed(0)
    H, HKV, D, BS = 32, 8, 128, 128
    q_lens, k_lens = [7, 1], [300, 1000]  # a chunked prefill and a decode
    nblk = [(k + BS - 1) // BS for k in k_lens]
    num_blocks = sum(nblk) + 3
    k_cache = torch.randn(num_blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=dev)
    block_table = torch.zeros(len(k_lens), max(nblk), dtype=torch.int32, device=dev)
    o = 0
    for i, n in enumerate(nblk):
        block_table[i, :n] = perm[o : o + n]
        o += n
    q = torch.randn(sum(q_lens), H, D, device=dev, dtype=torch.bfloat16)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    seqused_k = torch.tensor(k_lens, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    scale = D**-0.5
    fa_version = get_flash_attn_version()

    def run():
        flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            max_seqlen_q=max(q_lens),
            cu_seqlens_q=cu_q,
            max_seqlen_k=max(k_lens),
            seqused_k=seqused_k,
            softmax_scale=scale,
            causal=True,
            block_table=block_table,
            out=out,
            fa_version=fa_version,
        )

    run()
    torch.cuda.synchronize()
    err = 0.0
    for i in range(len(q_lens)):
        pages = block_table[i, : nblk[i]].long()
        k = k_cache[pages].reshape(-1, HKV, D)[: k_lens[i]]
        v = v_cache[pages].reshape(-1, HKV, D)[: k_lens[i]]
        ref = ref_attention(q[cu_q[i] : cu_q[i + 1]], k, v, scale)
        err = max(err, (out[cu_q[i] : cu_q[i + 1]].float() - ref).abs().max().item())
    assert err < 2e-2, f"max abs error {err:.3g} vs PyTorch"
    eager = out.clone()
    us = timed(run) * 1e6
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    out.zero_()
    with torch.cuda.graph(g):
        run()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "CUDA graph replay differs from the eager call"
    us_g = timed(g.replay) * 1e6
    return f"FA{fa_version}, max abs error {err:.2e}; {us:.1f} us eager, {us_g:.1f} us per graph replay"


@check("MiniMax-M3 sparse ops import (common/ops Triton, nvidia/ops CuTeDSL + quack)")
def _():
    t = time.perf_counter()
    importlib.import_module("vllm.models.minimax_m3.common.ops")
    t1 = time.perf_counter() - t
    importlib.import_module("vllm.models.minimax_m3.nvidia.ops")
    t2 = time.perf_counter() - t - t1
    importlib.import_module("vllm.models.minimax_m3.nvidia.sparse_attention_msa")
    return f"common.ops {t1:.2f} s, nvidia.ops {t2:.2f} s, nvidia.sparse_attention_msa ok"


@check("MiniMax-M3 nvidia model module imports (flashinfer used lazily there)")
def _():
    importlib.import_module("vllm.models.minimax_m3.nvidia.model")


@check("MiniMax-M3 Triton sparse decode (all blocks selected) vs PyTorch")
def _():
    from vllm.models.minimax_m3.common.ops import minimax_m3_sparse_attn_decode
    from vllm.models.minimax_m3.common.ops.sparse_attn import SPARSE_BLOCK_SIZE as BS

    torch.manual_seed(0)
    H, HKV, D = 16, 2, 128
    seq_lens = [200, 1000, 37]
    nblk = [(s + BS - 1) // BS for s in seq_lens]
    num_blocks = sum(nblk) + 2
    kv_cache = torch.randn(num_blocks, HKV, BS, 2 * D, device=dev, dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks, device=dev)
    block_table = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=dev)
    o = 0
    for i, n in enumerate(nblk):
        block_table[i, :n] = perm[o : o + n]
        o += n
    topk = max(nblk)
    topk_idx = torch.arange(topk, dtype=torch.int32, device=dev).expand(HKV, len(seq_lens), topk).contiguous()
    q = torch.randn(len(seq_lens), H, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    scale = D**-0.5

    def run():
        minimax_m3_sparse_attn_decode(q, kv_cache, topk_idx, block_table, sl, HKV, scale, out, decode_query_len=1)

    t = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    err = 0.0
    for i, n in enumerate(nblk):
        kv = kv_cache[block_table[i, :n].long()].permute(0, 2, 1, 3).reshape(-1, HKV, 2 * D)[: seq_lens[i]]
        ref = ref_attention(q[i : i + 1], kv[..., :D], kv[..., D:], scale)
        err = max(err, (out[i : i + 1].float() - ref).abs().max().item())
    us = timed(run) * 1e6
    msg = f"max abs error {err:.2e}; first call (Triton compile) {first:.1f} s, then {us:.1f} us"
    if err > 2e-2:
        return "WARN " + msg + " (check the layout assumed here: [blocks, kv_heads, 128, K|V])"
    return msg


@check("flashinfer and CuTeDSL import")
def _():
    import cutlass
    import flashinfer
    import quack

    return (
        f"flashinfer {getattr(flashinfer, '__version__', '?')}, cutlass-dsl {getattr(cutlass, '__version__', '?')}, "
        f"quack {getattr(quack, '__version__', '?')}"
    )


@check("requirements of the kit's packages met by what is installed")
def _():
    from importlib import metadata

    import vllm
    from packaging.requirements import Requirement

    site = os.path.dirname(os.path.dirname(vllm.__file__))
    dropped = {
        "tokenspeed-mla",
        "tilelang",
        "humming-kernels",
        "pynvvideocodec",
        "torchcodec",
        "nvidia-cutlass-dsl-libs-cu12",
    }
    extras = {
        "fastapi": {"standard"},
        "mistral-common": {"image"},
        "nvidia-cutlass-dsl": {"cu13"},
        "quack-kernels": {"cu13"},
        "uvicorn": {"standard"},
    }
    norm = lambda n: n.lower().replace("_", "-").replace(".", "-")  # noqa: E731
    kit = [d for d in metadata.distributions() if str(d.locate_file("")).rstrip("/") == site.rstrip("/")]
    problems = []
    for dist in kit:
        name = norm(dist.metadata["Name"])
        for rd in dist.requires or []:
            r = Requirement(rd)
            if r.marker and not any(r.marker.evaluate({"extra": e}) for e in extras.get(name, set()) | {""}):
                continue
            try:
                have = metadata.version(r.name)
            except metadata.PackageNotFoundError:
                if norm(r.name) not in dropped:
                    problems.append(f"{r.name} missing (for {name})")
                continue
            if r.specifier and not r.specifier.contains(have, prereleases=True):
                problems.append(f"{r.name} {have} is not {r.specifier} (for {name})")
    if problems:
        return "WARN " + "; ".join(sorted(set(problems)))
    return f"{len(kit)} distributions in {site} checked"


summary()
