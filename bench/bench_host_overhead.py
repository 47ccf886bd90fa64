"""Host (Python) time of one eager MSA layer call at M3 shapes, as the backend makes it, with a cProfile breakdown.

    python3 -m bench.bench_host_overhead [--calls N] [--group G] [--top K]
        [--python-only]

(on the GPU machine, CuTeDSL installed; with --python-only anywhere, see below). Cases: decode
batch 1 and 32 at 32K context, and one 2048-token prefill chunk at the end of a 32K context (M3_SHAPE,
SCALE, paged_problem of bench.problems; Kernels.select_blocks into the step's selection
(ops.layer_selection), Kernels.sparse_attention into a preallocated output, as vllm_msa's backend calls them, with
the kernels chosen once (ops.kernels), as the backend's MSAImpl holds them).
Each case reuses one step plan (msa_kernels.plan.StepPlan, made once as vLLM's builder makes a step's), as the
layers of a step share theirs, so what is measured is a layer's own cost, not the step's.

host us/call   wall time until the call returns, averaged over --calls calls: the calls run in groups
               of --group with a synchronize between groups (not timed), so the GPU's launch queue never
               fills and makes a launch wait for the GPU
synced us/call the same groups' wall time with the synchronize included: the GPU's time where it is
               the larger (then the host time above hides behind the GPU in serving)
Then, per case, cProfile over the same groups (the synchronize outside the profile): the --top
functions by own time (tottime), with their call counts per layer call. Last, the host cost of the pieces a
layer call is made of, each timed alone the same way: a TVM-FFI call that does nothing (tvm_ffi's testing.nop)
with 3 and 10 CUDA tensors, one compiled CuTeDSL kernel call (combine.py's, on prepared tensors), a
torch.empty on the GPU and a small torch kernel launch, so the 103 us of the fifth session can be told apart.

Warm-up calls come first (the first compiles or loads the kernels); the table says which
implementation runs each step (ops.describe), since the PyTorch path would be timed otherwise.

--python-only (any machine, CPU tensors): ops routes every step to the CuTeDSL launchers as on a Hopper GPU,
but each compiled kernel is a no-op (msa_kernels.stand_ins) and nothing is allocated on a GPU: what is timed
is the call's Python (routing, launcher arithmetic, views, host allocations), without the compiled calls
(kernel launches, their argument checks) that the GPU run adds. TVM-FFI's own argument passing is printed for scale
(tvm_ffi's testing.nop with the decode attention call's tensor count).
"""

import argparse
import contextlib
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from bench.problems import M3_SHAPE, SCALE, paged_problem
from msa_kernels import ops
from msa_kernels.plan import StepPlan
from msa_kernels.stand_ins import no_op, stand_in_kernels

REPO = str(Path(__file__).resolve().parents[1]) + "/"
CONTEXT = 32768
CASES = {  # name: requests (context tokens, of which new)
    "decode batch 1": [(CONTEXT, 1)],
    "decode batch 32": [(CONTEXT, 1)] * 32,
    "prefill chunk 2048": [(CONTEXT, 2048)],
}


def layer_call(requests: list[tuple[int, int]], device: str = "cuda"):
    """A no-argument eager layer call on one problem of these requests, as vllm_msa/backend.py's MSAImpl makes it
    with the kernels it holds (ops.kernels, chosen once): the selection into the step's (ops.layer_selection), then
    the attention into the layer's output."""
    batch, q, index_q, kv, index_keys, _ = paged_problem(requests, device=device)
    plan = StepPlan.of(batch)  # as vLLM's builder plans the step once for all its layers
    out = torch.empty_like(q)
    chosen = ops.kernels(q.device, q.dtype, index_keys.dtype, False, M3_SHAPE)

    def call():
        selected = chosen.select_blocks(index_q, index_keys, plan, out=ops.layer_selection(plan, M3_SHAPE))
        chosen.sparse_attention(q, kv, plan, selected, SCALE, out=out)

    return call


def run_groups(call, calls: int, group: int, profile: cProfile.Profile | None = None) -> tuple[float, float]:
    """(host seconds per call, synced seconds per call) over `calls` calls in groups of `group`."""
    host = synced = 0.0
    done = 0
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    while done < calls:
        n = min(group, calls - done)
        sync()
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        for _ in range(n):
            call()
        if profile is not None:
            profile.disable()
        returned = time.perf_counter()
        sync()
        host += returned - start
        synced += time.perf_counter() - start
        done += n
    return host / calls, synced / calls


def breakdown(profile: cProfile.Profile, calls: int, top: int) -> str:
    """The top functions by own time, per layer call."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    lines = ["| function | calls/layer | own us/layer | cumulative us/layer |", "|---|---|---|---|"]
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{file.removeprefix(REPO).rsplit('site-packages/', 1)[-1]}:{line}({name})" if line else name
        lines.append(f"| {where} | {ncalls / calls:.1f} | {tottime / calls * 1e6:.1f} | {cumtime / calls * 1e6:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per case (and as many profiled)")
    parser.add_argument("--group", type=int, default=4, help="calls between two synchronizes")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    parser.add_argument("--top", type=int, default=25, help="functions of the cProfile breakdown")
    parser.add_argument("--python-only", action="store_true", help="CPU tensors, every compiled kernel a no-op")
    args = parser.parse_args()
    device = "cpu" if args.python_only else "cuda"
    with stand_in_kernels(no_op) if args.python_only else contextlib.nullcontext():
        measure(args, device)


def measure(args: argparse.Namespace, device: str) -> None:
    if args.python_only:
        print(
            f"Python only (kernels no-ops, CPU tensors): {ops.describe(torch.device(device), torch.bfloat16, M3_SHAPE)}"
        )
        nop = nop_call(10, device)
        run_groups(nop, args.warmup, args.group)
        nop_seconds = run_groups(nop, args.calls, args.group)[0]
        print(f"TVM-FFI argument passing, 10 tensors: {nop_seconds * 1e6:.2f} us a call\n")
    else:
        print(f"{torch.cuda.get_device_name()}: {ops.describe(torch.device('cuda'), torch.bfloat16, M3_SHAPE)}\n")
    calls = {name: layer_call(requests, device) for name, requests in CASES.items()}
    print("| case | host us/call | synced us/call |\n|---|---|---|")
    for name, call in calls.items():
        run_groups(call, args.warmup, args.group)
        host, synced = run_groups(call, args.calls, args.group)
        print(f"| {name} | {host * 1e6:.1f} | {synced * 1e6:.1f} |", flush=True)
    for name, call in calls.items():
        profile = cProfile.Profile()
        run_groups(call, args.calls, args.group, profile)
        print(f"\n{name}: cProfile, top {args.top} by own time (profiling slows each Python call)\n")
        print(breakdown(profile, args.calls, args.top), flush=True)
    if not args.python_only:
        print("\n| piece | host us/call |\n|---|---|")
        for name, call in piece_calls().items():
            run_groups(call, args.warmup, args.group)
            print(f"| {name} | {run_groups(call, args.calls, args.group)[0] * 1e6:.2f} |", flush=True)


def piece_calls() -> dict:
    """No-argument calls of the pieces an eager layer call is made of, on the GPU."""
    from msa_kernels.cute.combine import combine_splits

    tensor = torch.zeros(4, device="cuda")
    splits, hq, d = 32, M3_SHAPE.num_q_heads, M3_SHAPE.head_dim
    partial = torch.zeros(splits, 1, hq, d, device="cuda")
    lse, out = torch.zeros(splits, 1, hq, device="cuda"), torch.empty(1, hq, d, dtype=torch.bfloat16, device="cuda")
    return {
        "TVM-FFI no-op call, 3 CUDA tensors": nop_call(3, "cuda"),
        "TVM-FFI no-op call, 10 CUDA tensors": nop_call(10, "cuda"),
        "compiled CuTeDSL kernel call (combine, 3 tensors)": lambda: combine_splits(partial, lse, out),
        "torch.empty on the GPU (32 x 64 x 128 fp32)": lambda: torch.empty(splits, hq, d, device="cuda"),
        "torch kernel launch (add_ on 4 floats)": lambda: tensor.add_(1),
    }


def nop_call(tensors: int, device: str):
    """A no-argument TVM-FFI call that does nothing (tvm_ffi's testing.nop) with this many torch tensors."""
    import tvm_ffi

    nop = tvm_ffi.get_global_func("testing.nop")
    args = [torch.zeros(4, device=device) for _ in range(tensors)]
    return lambda: nop(*args)


if __name__ == "__main__":
    main()
