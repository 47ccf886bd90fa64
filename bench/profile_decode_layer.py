"""Per-kernel GPU time of our decode MSA layer at M3's shapes, for Nsight Compute (each kernel's duration and
where it stalls):

    ncu --clock-control none --launch-skip 40 --launch-count 8 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats python3 -m bench.profile_decode_layer --context 131072 --batch 1 --ncu

Builds bench_vs_vllm_m3's random case (shuffled pages, NaN in unowned slots) and calls the layer (index
scores, top-k, sparse attention, combine: ops.msa_attention) --calls times; the first calls compile and warm
up, so skip them with --launch-skip (10 calls of 4 kernels: 40). Without --ncu it prints the kernels' times from
torch.profiler (which cannot run under ncu).
"""

import argparse

import torch

from bench.bench_vs_vllm_m3 import our_steps, random_case
from bench.problems import M3_SHAPE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--ncu", action="store_true", help="running under Nsight Compute: no torch.profiler")
    args = parser.parse_args()
    case = random_case(M3_SHAPE, args.batch, args.context, q_len=1, device="cuda")
    layer = our_steps(case).layer
    for _ in range(10):
        layer()
    torch.cuda.synchronize()
    if args.ncu:
        for _ in range(args.calls - 10):
            layer()
        torch.cuda.synchronize()
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(args.calls - 10):
            layer()
        torch.cuda.synchronize()
    print(f"decode {args.context} x {args.batch}, {args.calls - 10} layer calls profiled (GPU time per call):")
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
