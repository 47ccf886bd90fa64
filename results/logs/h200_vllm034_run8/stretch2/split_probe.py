# Exploratory: graph-time the decode attention kernel and the combine kernel apart at 128K x 1 (M3 shapes).
import torch
from msa_kernels.bench.bench_vs_vllm_m3 import random_case, our_steps
from msa_kernels.bench.problems import M3_SHAPE
from msa_kernels.bench.timing import graph_timed
from msa_kernels.cute import sparse_attn
from msa_kernels.cute.combine import combine_splits
for batch in (1, 32):
    case = random_case(M3_SHAPE, batch, 131072, 1, "cuda")
    sel = our_steps(case).index()
    inputs = sparse_attn.attention_inputs(case.q, case.kv_cache, case.batch, sel)
    q, kv, bt, sl, pos, selc = inputs
    out = torch.empty_like(case.q)
    for splits in (1, 4, 8, 16, 32):
        plan = sparse_attn._launch_plan(M3_SHAPE, batch, 16, splits, False, 0)
        T, hq, d = batch, 64, 128
        lse = torch.empty((plan.splits, T, hq), dtype=torch.float32, device="cuda")
        part = torch.empty((plan.splits, T, hq, d), dtype=torch.float32, device="cuda")
        target = part if plan.splits > 1 else out.view(1, T, hq, d)
        att = lambda: plan.kernel(q, kv, bt, sl, case.batch.token_requests, pos, selc, target, lse, None, case.scale, plan.tiles_per_split)
        t_att = graph_timed(att)
        t_comb = graph_timed(lambda: combine_splits(part, lse, out)) if plan.splits > 1 else 0
        t_empty = graph_timed(lambda: torch.empty(1, device="cuda").zero_())
        print(f"batch {batch} splits {plan.splits} tiles/split {plan.tiles_per_split}: attention {t_att*1e6:.1f} us, combine {t_comb*1e6:.1f} us, one tiny kernel {t_empty*1e6:.1f} us")
