"""Benchmark: one MSA layer on steps that mix decode requests with a prefill chunk (chunked prefill), M3 shapes.

    python -m bench.bench_mixed_batch   (on the GPU machine, CuTeDSL installed)

Each case is one vLLM step: N decode requests (one new token each) and one request prefilling a chunk,
decode requests first as vLLM's scheduler orders them. Columns: the layer (index scores, top-k, sparse
attention) on the mixed step, as FLASH_MSA runs it: msa_kernels.ops.msa_attention on the step's plan, its batch
split once into its decode and prefill parts (msa_kernels.plan.StepPlan, made once, so the timed calls reuse
it as a step's layers do) and runs each part's kernels into its rows of one output; the same layer on
the decode requests alone and on the prefill chunk alone; mixed / (decode alone + prefill alone): 1.0
means mixing costs nothing. Eager times (a step with a prefill chunk runs its layers outside CUDA
graphs), CUDA events, one run.
"""

import time

import torch

from bench.problems import M3_SHAPE, SCALE, paged_problem
from bench.timing import timed
from msa_kernels import ops
from msa_kernels.plan import StepPlan

CASES = (  # (decode requests, their context, prefill chunk tokens, the chunk request's context)
    (32, 8192, 512, 8192),
    (31, 32768, 2048, 32768),
    (8, 131072, 8192, 131072),
)


def layer_time(requests) -> float:
    batch, q, index_q, kv, index_cache, _ = paged_problem(requests)
    plan = StepPlan.of(batch)  # as vLLM's builder plans a step once for all its layers
    return timed(lambda: ops.msa_attention(q, index_q, kv, index_cache, plan, M3_SHAPE, SCALE), iters=5)


def main():
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}: M3 shapes, bf16, eager layer times\n")
    print(
        "| decodes x context | chunk tokens @ context | mixed step ms | decodes alone ms | chunk alone ms "
        "| mixed / (decodes + chunk) |"
    )
    print("|---|---|---|---|---|---|")
    for decodes, decode_context, chunk, chunk_context in CASES:
        decode_requests = [(decode_context, 1)] * decodes
        chunk_request = [(chunk_context, chunk)]
        mixed = layer_time(decode_requests + chunk_request)
        alone = layer_time(decode_requests), layer_time(chunk_request)
        print(
            f"| {decodes} x {decode_context} | {chunk} @ {chunk_context} | {mixed * 1e3:.3f} | {alone[0] * 1e3:.3f} "
            f"| {alone[1] * 1e3:.3f} | {mixed / sum(alone):.2f} |"
        )
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
