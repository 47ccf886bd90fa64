"""Quick prefill check (proxy scores + whole MSA layer at 32K and 128K, M3 shapes), the run behind the
"Prefill proxy scores on tensor cores" table of RESULTS.md; bench_sparse_attention.py prefill section
measures the same and more.

    PYTHONPATH=$PWD:$PYTHONPATH python3 kernels/bench/prefill_proxy_quick.py
"""

from kernels import cute as ck
from kernels import ops
from kernels.bench.bench_sparse_attention import SHAPE, paged_problem
from kernels.bench.timing import timed

for n in (32768, 131072):
    pb, q, iq, kv, proxy, sel = paged_problem(1, n, n)
    t = timed(lambda: ck.proxy_block_scores(iq, proxy, pb, SHAPE), iters=3)
    fl = 2 * 4 * 128 * n * 128 * (n // 128 + 1) / 2
    tl = timed(lambda: ops.msa_attention(q, iq, kv, proxy, pb, SHAPE, 0.088), iters=2)
    print(f"prefill {n}: proxy {t*1e3:.2f} ms {fl/t/1e12:.0f} TFLOP/s; MSA layer {tl*1e3:.2f} ms", flush=True)
