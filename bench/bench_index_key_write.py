"""Benchmark: the step's index-key write (msa_kernels/cute/index_key_write.py) against the path it replaced.

    python -m bench.bench_index_key_write [--tokens 1 32 2048 32768]
        (GPU machine; vLLM installed for its column: source dev/gpu/install_vllm.sh)

M3's index keys (Hki 1, Dp 128, bf16) written at random distinct slots of a 1M-token paged cache, as one layer of
a step does, timed in CUDA graphs (host overhead removed, as vLLM replays decode): ours into a bf16 cache and
quantised into an FP8 cache (Fp8IndexKeyCache), and vLLM's reshape_and_cache_flash with the bf16 cache passed as
both K and V (what FLASH_MSA ran before: every row written twice). Each side's pages are checked against the
reference's before timing. "of copy" is the bytes a side must move (the keys read, the rows and scales written,
once) over its time, as a fraction of this GPU's measured copy bandwidth (read + write). The timed calls rotate
over ROTATION sets of keys and slots (one graph's calls each read and write their own), so a prefill chunk's keys
are read from DRAM, not from L2 (one set of 32768 tokens is 8 MB; the H100's and H200's L2 50 MB).
"""

import argparse
import itertools

import torch

from bench.problems import M3_SHAPE
from bench.timing import ceilings, graph_timed
from msa_kernels import reference
from msa_kernels.cute import index_key_write
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache

CONTEXT = 1 << 20
ROTATION = 10  # sets of keys and slots the timed calls cycle over: graph_timed's calls per graph


def vllm_double_write():
    """vLLM's reshape_and_cache_flash as FLASH_MSA called it for bf16 index keys (compat.write_paged_cuda with the
    cache as K and V), or None where vLLM is missing."""
    try:
        from vllm_msa import compat
    except ImportError:
        return None
    return lambda cache, slots, keys: compat.write_paged_cuda(cache, cache, slots, keys, keys)


def rotated_graph_timed(write, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """graph_timed of write(keys, slots), each captured call on the next of `inputs`."""
    rotation = itertools.cycle(inputs)
    return graph_timed(lambda: write(*next(rotation)), iters=len(inputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 2048, 32768])
    args = parser.parse_args()
    shape = M3_SHAPE
    hki, dp, block = shape.num_index_key_heads, shape.index_head_dim, shape.block_size
    pages = CONTEXT // block
    bandwidth, _ = ceilings()
    vllm_write = vllm_double_write()
    print(f"{torch.cuda.get_device_name()}: index-key write of one layer (Hki {hki}, Dp {dp}), us per call in a")
    print(f"CUDA graph, a {CONTEXT}-slot cache; copy bandwidth measured {bandwidth / 1e12:.2f} TB/s\n")
    print("| tokens | ours bf16 | of copy | vLLM reshape_and_cache_flash (K = V) | ours / vLLM | ours FP8 | of copy |")
    print("|---|---|---|---|---|---|---|")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for tokens in args.tokens:
        inputs = [
            (
                torch.randn(tokens, hki, dp, device="cuda", generator=generator).to(torch.bfloat16),
                torch.randperm(pages * block, device="cuda", generator=generator)[:tokens],
            )
            for _ in range(ROTATION)
        ]
        keys, slots = inputs[0]  # the pages checked against the reference's
        bf16 = torch.zeros(pages, block, hki, dp, dtype=torch.bfloat16, device="cuda")
        fp8 = Fp8IndexKeyCache.quantize(torch.zeros(pages, block, hki, dp, dtype=torch.bfloat16, device="cuda"))
        want = bf16.clone()
        reference.write_index_keys(want, slots, keys)
        sides = {"bf16": (index_key_write.write_index_keys, bf16)}
        if vllm_write is not None:
            sides["vllm"] = (vllm_write, bf16.clone())
        times = {}
        for name, (write, cache) in sides.items():
            write(cache, slots, keys)
            if not torch.equal(cache, want):
                raise AssertionError(f"{tokens} tokens: {name}'s pages differ from the reference's")
            times[name] = rotated_graph_timed(
                lambda keys, slots, write=write, cache=cache: write(cache, slots, keys), inputs
            )
        want_fp8 = Fp8IndexKeyCache.quantize(torch.zeros_like(bf16))
        reference.write_index_keys(want_fp8, slots, keys)
        index_key_write.write_index_keys(fp8, slots, keys)
        if not (torch.equal(fp8.values, want_fp8.values) and torch.equal(fp8.scales, want_fp8.scales)):
            raise AssertionError(f"{tokens} tokens: the FP8 pages differ from the reference's")
        times["fp8"] = rotated_graph_timed(
            lambda keys, slots: index_key_write.write_index_keys(fp8, slots, keys), inputs
        )
        rows, slot_bytes = tokens * hki, slots.element_size() * tokens
        moved = {"bf16": rows * dp * 2 * 2 + slot_bytes, "fp8": rows * (dp * 2 + dp + 4) + slot_bytes}
        vllm_cells = ["-", "-"]
        if "vllm" in times:
            vllm_cells = [f"{times['vllm'] * 1e6:.2f}", f"{times['bf16'] / times['vllm']:.2f}x"]
        print(
            f"| {tokens} | {times['bf16'] * 1e6:.2f} | {moved['bf16'] / times['bf16'] / bandwidth:.1%} | "
            + " | ".join(vllm_cells)
            + f" | {times['fp8'] * 1e6:.2f} | {moved['fp8'] / times['fp8'] / bandwidth:.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
