# The per-step cost of FLASH_MSA's metrics on this CPU: StepStats.record on the last MSA layer's selection
# (the demo's 4 index heads, top-4) and, with an FP8 K/V cache, count_saturated on one layer's K/V (Hkv 2, D 32).
import os, time, torch
os.environ.pop("FLASH_MSA_METRICS_DIR", None)
from vllm_msa.metrics import StepStats
torch.set_num_threads(2)
stats = StepStats(torch.device("cpu"), "demo")
def timed(fn, n=200):
    for _ in range(20): fn()
    start = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - start) / n * 1e6
for tokens, decode in ((8, 8), (2048, 0)):
    selected = torch.randint(-1, 24, (tokens, 4, 4), dtype=torch.int32)
    positions = torch.randint(0, 3000, (tokens,))
    key, value = torch.randn(tokens, 2, 32), torch.randn(tokens, 2, 32)
    record = timed(lambda: stats.record(selected, positions, 128, decode, layers=3))
    saturated = timed(lambda: stats.count_saturated(key, value, (1.0, 1.0)))
    print(f"{tokens} tokens: record {record:.0f} us per step, count_saturated {saturated:.0f} us per MSA layer call")
