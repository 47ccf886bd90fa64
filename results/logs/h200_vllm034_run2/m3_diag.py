"""Throwaway GPU diagnostic (not committed): where do FLASH_MSA and vLLM's M3 part on the 6000-token prompt?"""
import json
import os
import random
import sys


def main(model_dir, backend, torch_path):
    if torch_path:
        from kernels import ops
        ops._cute_available = lambda device_index: False
    from vllm import LLM, SamplingParams

    rng = random.Random(7)
    prompt = [rng.randrange(5, 4096) for _ in range(6000)]
    common = [3547, 1819, 3492, 1809, 2423, 1103, 1707, 3906, 3022, 3669, 854, 2581, 295, 3035, 2723]
    llm = LLM(model=model_dir, attention_backend=backend or None, block_size=128, max_model_len=8192,
              dtype="bfloat16", gpu_memory_utilization=0.3, seed=0, enforce_eager=torch_path)
    out = {}

    def run(name, tokens, n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=5)
        o = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0].outputs[0]
        out[name] = {"tokens": list(o.token_ids),
                     "logprobs": [{str(k): round(v.logprob, 4) for k, v in s.items()} for s in o.logprobs]}

    run("decode16", prompt, 16)
    llm.reset_prefix_cache()
    run("tf_full_prefill", prompt + common, 1)
    run("tf_cached_chunk", prompt + common, 1)
    llm.reset_prefix_cache()
    run("tf_minus1_full", prompt + common[:-1], 2)
    print("DIAG " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "torch")
