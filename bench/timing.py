"""GPU timing and the device's ceilings, shared by the benchmarks of kernels/bench.

timed        CUDA-event time per call of back-to-back calls (host overhead included)
graph_timed  time per call replayed from one CUDA graph (host overhead removed, as vLLM decode)
ceilings     device copy bandwidth (read + write counted) and the bf16 8192^3 matmul rate
fp8_matmul_rate  the e4m3 8192^3 matmul rate
"""

import torch


def timed(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3


def graph_timed(fn, iters=10):
    """GPU time per call with host overhead removed: `iters` calls captured in one CUDA graph, as vLLM
    runs decode."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return timed(graph.replay, iters=3) / iters


def ceilings():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / timed(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192**3 / timed(lambda: a @ b)
    return bw, flops


def fp8_matmul_rate():
    """FLOP/s of an e4m3 8192^3 matmul (torch._scaled_mm, per-tensor scales, bf16 out) with fast accumulation,
    which accumulates as the kernels' FP8 warpgroup MMAs do."""
    a, b = (torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    one = torch.ones((), device="cuda")
    matmul = lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
    return 2 * 8192**3 / timed(matmul)
