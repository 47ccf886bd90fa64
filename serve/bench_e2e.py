"""End-to-end serving benchmark: one checkpoint served several ways, `vllm bench serve` against each.

Owns the serving comparison of issue 4. Each server configuration is the real `vllm serve MODEL_DIR
<config args> <extra args>` on 127.0.0.1, sized for the load (--max-num-seqs = the largest --concurrency: few
CUDA graphs to capture) and without prefix caching (the warm-up requests repeat the first prompt).
Once /health answers, `vllm bench serve` (fixed input and output lengths, --ignore-eos, bounded
concurrency) runs once per input length and --concurrency value, then the server stops. Each run first
sends --warmups x its concurrency unmeasured requests, that many at a time, so the batch sizes it decodes
at compile and autotune before the numbers: a JIT compile of a new batch shape otherwise lands in the
measured run (2026-12-04: vLLM's fused_moe Triton kernel compiled during FLASH_MSA's 32K x 16 run, one
825 ms step, 13 ms on each request's TPOT; the servers benchmarked after it loaded the kernel from Triton's
cache). Its prompts (--prompts): `random`, vLLM's random dataset (random token ids); `repeated`, texts that
repeat a random piece of 4 to 300 tokens up to the input length (written to --out as prompts-LEN.jsonl,
vLLM's custom dataset, as they are; vLLM reads them with pandas, which the H200 image has and the CPU .venv
has not).

By default the servers run one after another, each with --gpu-memory-utilization. With
--parallel-start all of them start at once on ports --port, --port+1, ..., each with an equal share
(--gpu-memory-utilization / N), so their start-up costs overlap; once every server is healthy or has
failed, they are benchmarked one after another. Progress (server, input length) is printed as it
goes; a server that fails to start, dies, or whose benchmark fails is reported with its log tail,
and the other servers are still measured.

--out gets summary.md (TTFT, TPOT, median and p99 ITL and output throughput per input length, concurrency
and configuration, with the first configuration's TTFT, TPOT and ITL divided by each one's; with
speculative decoding also its acceptance rate and length; rewritten after each server, or each group started
together, so a run stopped early keeps the rows it measured), one SVG bar chart per input length and
concurrency (e2e-LEN-cN.svg), the raw `vllm bench` JSON (with each request's TTFT and inter-token latencies,
--save-detailed: where the median ITL hides which steps were slow), and the server and bench logs.

--greedy-tokens N asks each server, after its loads, for N greedy tokens (temperature 0, top-5 logprobs) of
one random prompt per input length, the same token ids for every server (seeded by the length); summary.md then
says per input length how many leading tokens each configuration shares with the first and, at the first that
differs, the logit gap: the first configuration's logprob of its own token minus that of the other's token (the
softmax's normaliser cancels; '>' where the other's token is not among its top 5). Tokens and logprobs:
greedy-NAME-LEN.json. (M3's `dense` configuration runs other weights, below: its tokens are not comparable.)

--speculative-config JSON serves every configuration twice: as it is, and with `--speculative-config
JSON` (named NAME+METHOD, e.g. FLASH_MSA+ngram), so summary.md has TPOT with and without speculation
beside the acceptance rate (accepted / drafted tokens, %) and length (tokens per verification step) that
`vllm bench serve` reads from the server's /metrics. A random-weight checkpoint gets n-gram drafts
accepted only where its own outputs fall into loops, which greedy outputs (--temperature 0) soon do
after --prompts repeated, hardly after random prompts or when sampling at the server's default
temperature 1: the numbers measure what verification costs and saves at that acceptance, not what a
trained model would accept.

Default configurations, by the checkpoint's architecture (--config NAME='ARGS' replaces them):
- FlashMSAForCausalLM: `FLASH_MSA`; `dense`: the same weights with every layer dense
  (msa_config.dense_layers = all layers) on --dense-backend.
- MiniMax-M3 (MiniMaxM3SparseFor{CausalLM,ConditionalGeneration}), all with --block-size 128 (one
  sparse block per KV page, the only page size vLLM's M3 sparse backend serves):
  `FLASH_MSA`: `--attention-backend FLASH_MSA`, this plugin's M3 (sparse layers on MSAAttention).
  `FLASH_MSA-fp8-index`: the same with FP8 index keys (`--attention-config '{"indexer_kv_dtype": "fp8"}'`;
  vLLM's M3 keeps bf16 index keys on Hopper: its Triton indexer refuses FP8).
  `MINIMAX_M3_SPARSE`: `--attention-backend FLASH_ATTN`, vLLM's own M3. Its sparse layers bind
  MiniMaxM3SparseBackend themselves (Triton kernels on Hopper); the flag picks the dense layers'
  backend, and MINIMAX_M3_SPARSE cannot be that flag (vLLM refuses a sparse-only backend for them).
  `dense`: `--attention-backend FLASH_ATTN --hf-overrides` (compat.m3_all_dense_overrides) with
  sparse_attention_freq all 0 (vLLM's M3 then builds every layer as dense attention)
  `--load-format dummy`: vLLM's M3 loader folds index_{q,k}_proj into the layer's qkv_proj, which a
  dense layer refuses (QKVParallelLinear: shard id 'index_q'), so this one runs vLLM's seeded random
  weights: attention and GEMM cost do not depend on weight values (only MoE routing does).
  (--dense-backend replaces FLASH_ATTN.)

    python serve/bench_e2e.py MODEL_DIR --input-lens 8192 32768 131072 [--output-len 128]
        [--num-prompts 16] [--concurrency 1 16] [--warmups 1] [--prompts {random,repeated}] [--temperature T]
        [--config NAME='vllm serve args' ...] [--only NAME ...] [--speculative-config JSON]
        [--greedy-tokens N] [--dense-backend FLASH_ATTN] [--parallel-start] [--gpu-memory-utilization 0.9]
        [--port 8123] [--out DIR] [-- extra args for every server]

Issue 45 on one H100 (M3's 60-layer mix; FLASH_MSA with bf16 and FP8 index keys and vLLM's M3, started together;
results/README.md, "Serving on the GPU, seventeenth session"):

    python3 serve/build_m3_model.py /tmp/m3mix --preset m3-layer-mix
    python3 serve/bench_e2e.py /tmp/m3mix --only FLASH_MSA FLASH_MSA-fp8-index MINIMAX_M3_SPARSE \\
        --input-lens 32768 --output-len 64 --num-prompts 8 --concurrency 1 16 --parallel-start \\
        --startup-timeout 600 --bench-timeout 200 --out $OUT/e2e -- --kv-cache-memory-bytes 18G

(--kv-cache-memory-bytes: vLLM otherwise sizes each KV cache by profiling the device's free memory,
which the other servers starting at the same time change.)

A 1M-token prompt on one GPU (issue 45 item 2: FLASH_MSA against vLLM's M3 on the same 1M-position weights, the
first 16 greedy tokens compared; the 8192-token run first compiles the kernels, so --warmups 0 keeps a second 1M
prompt out of the time; each greedy request prefills its prompt once more):

    python3 serve/build_m3_model.py /tmp/m3a1m --preset m3-attention-1m
    python3 serve/bench_e2e.py /tmp/m3a1m --only FLASH_MSA MINIMAX_M3_SPARSE --input-lens 8192 1048000 \\
        --output-len 16 --num-prompts 1 --concurrency 1 --warmups 0 --greedy-tokens 16 --startup-timeout 600 \\
        --bench-timeout 600 --out /tmp/e2e1m -- --kv-cache-memory-bytes 30G

Speculative decoding on one H200 (FLASH_MSA with and without n-gram speculation, M3's attention shapes):

    python3 serve/build_demo_model.py /tmp/msa-m3 --preset m3-attention
    NGRAM='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    python3 serve/bench_e2e.py /tmp/msa-m3 --only FLASH_MSA --input-lens 8192 32768 --output-len 256 \\
        --num-prompts 16 --concurrency 1 8 --prompts repeated --temperature 0 --speculative-config "$NGRAM" \\
        --out $OUT/e2e-spec
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a script
from serve import local_server
from serve.local_server import NotHealthyError, healthy, post_json, wait_healthy

# Median ITL: the decode step alone (TPOT also carries the steps that run other requests' prefill chunks); ITL p99:
# the steps that did run them.
METRICS = (
    ("mean_ttft_ms", "TTFT ms"),
    ("mean_tpot_ms", "TPOT ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
    ("output_throughput", "out tok/s"),
)
RATIOS = (("mean_ttft_ms", "TTFT"), ("mean_tpot_ms", "TPOT"), ("median_itl_ms", "ITL p50"))
# What `vllm bench serve` records from the server's spec-decode counters (only where it speculates).
SPECULATION = (("spec_decode_acceptance_rate", "accept %"), ("spec_decode_acceptance_length", "accept len"))
M3_ARCHITECTURES = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")
LOG_TAIL_LINES = 40
PROMPT_SLACK = 64  # tokens of --max-model-len beyond input + output: vllm bench's random prompts may re-tokenize longer
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")  # bar colors, one per configuration
REPEATED_PERIODS = (4, 10, 25, 40, 100, 300)  # tokens of the piece each --prompts repeated prompt repeats, in turn
GREEDY_TOP = 5  # logprobs per greedy token (--greedy-tokens): the logit gap where the other's token is among them


@dataclass
class Server:
    name: str
    args: list[str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0  # time.monotonic() at the start
    results: dict[tuple[int, int], dict] = field(default_factory=dict)  # (input length, concurrency): result
    greedy: dict[int, dict] = field(default_factory=dict)  # input length: greedy_tokens' tokens and logprobs
    errors: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# ------------------------------------------------------------------------------------ configurations


def default_configs(model_dir: Path, dense_backend: str) -> dict[str, list[str]]:
    config = json.loads((model_dir / "config.json").read_text())
    architectures = config.get("architectures") or []
    if "FlashMSAForCausalLM" in architectures:
        return flash_msa_configs(config, dense_backend)
    if any(a in M3_ARCHITECTURES for a in architectures):
        return minimax_m3_configs(model_dir, dense_backend)
    raise ValueError(f"no default configurations for architectures {architectures}: pass --config")


def flash_msa_configs(config: dict, dense_backend: str) -> dict[str, list[str]]:
    all_dense = {**config["msa_config"], "dense_layers": list(range(config["num_hidden_layers"]))}
    return {
        "FLASH_MSA": ["--attention-backend", "FLASH_MSA"],
        "dense": ["--attention-backend", dense_backend, "--hf-overrides", json.dumps({"msa_config": all_dense})],
    }


def minimax_m3_configs(model_dir: Path, dense_backend: str) -> dict[str, list[str]]:
    from vllm.transformers_utils.config import get_config

    from vllm_msa import compat

    text = get_config(str(model_dir), trust_remote_code=False).get_text_config()  # as this vLLM reads it
    override = {"text_config": compat.m3_all_dense_overrides(text)}
    paged = ["--block-size", str(compat.m3_sparse_fields(text)["block_size"])]
    return {
        "FLASH_MSA": ["--attention-backend", "FLASH_MSA", *paged],
        "FLASH_MSA-fp8-index": [
            "--attention-backend",
            "FLASH_MSA",
            *paged,
            "--attention-config",
            json.dumps({"indexer_kv_dtype": "fp8"}),
        ],
        "MINIMAX_M3_SPARSE": ["--attention-backend", dense_backend, *paged],
        "dense": [
            "--attention-backend",
            dense_backend,
            *paged,
            "--hf-overrides",
            json.dumps(override),
            "--load-format",
            "dummy",
        ],
    }


# ------------------------------------------------------------------------------------------ servers


def vllm_command() -> list[str]:
    exe = shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(lines[-LOG_TAIL_LINES:])


def report_failure(server: Server, message: str, log: Path) -> None:
    server.errors.append(f"{message} (see {log.name})")
    print(f"[{server.name}] FAILED: {message}\n--- last lines of {log} ---\n{log_tail(log)}\n---", flush=True)


def start_server(server: Server, memory_share: float, common: list[str], opts) -> None:
    if healthy(server.url):
        report_failure(server, f"port {server.port} already serves something", server.log)
        return
    cmd = [
        *vllm_command(),
        "serve",
        str(opts.model_dir),
        "--served-model-name",
        "bench",
        "--host",
        "127.0.0.1",
        "--port",
        str(server.port),
        "--max-model-len",
        str(max(opts.input_lens) + opts.output_len + PROMPT_SLACK),
        "--gpu-memory-utilization",
        f"{memory_share:.3f}",
        "--max-num-seqs",
        str(max(opts.concurrency)),
        "--no-enable-prefix-caching",
        *server.args,
        *common,
    ]
    print(f"[{server.name}] starting on port {server.port}: {shlex.join(cmd)}", flush=True)
    server.proc = local_server.start(cmd, server.log)
    server.started = time.monotonic()


def wait_until_healthy(servers: list[Server], timeout_s: float) -> None:
    """Wait for each started server in turn until it is healthy, has exited or ran out of time (each against
    its own start, so servers started together keep their overlap); print each outcome."""
    for server in [s for s in servers if s.proc is not None]:
        try:
            waited = wait_healthy(server.url, timeout_s, proc=server.proc, started=server.started)
        except NotHealthyError as e:
            report_failure(server, str(e), server.log)
        else:
            print(f"[{server.name}] healthy after {waited:.0f} s", flush=True)


def stop_server(server: Server) -> None:
    if server.proc is not None:
        local_server.stop(server.proc)


# ------------------------------------------------------------------------------------------ benchmark


def write_repeated_prompts(model_dir: Path, input_len: int, count: int, path: Path) -> None:
    """count prompts of input_len tokens (the model's tokenizer, within a token), each a random piece of
    REPEATED_PERIODS tokens (in turn) repeated, as vLLM's custom dataset reads them (JSON lines)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(input_len)
    with open(path, "w") as f:
        for i in range(count):
            period = REPEATED_PERIODS[i % len(REPEATED_PERIODS)]
            piece = tokenizer.decode([rng.choice(vocab) for _ in range(period)])
            # Tokens of the repeated text itself, cut at input_len: decoding them gives text that tokenizes
            # back to them (random ids, decoded, would tokenize to up to 40% more tokens).
            ids = tokenizer(piece * (input_len // period + 1), add_special_tokens=False).input_ids[:input_len]
            f.write(json.dumps({"prompt": tokenizer.decode(ids)}) + "\n")


def prompt_args(input_len: int, opts) -> list[str]:
    """vllm bench serve's dataset arguments for --prompts."""
    if opts.prompts == "repeated":
        return [
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(opts.out / f"prompts-{input_len}.jsonl"),
            "--custom-output-len",
            str(opts.output_len),
            "--skip-chat-template",
        ]
    return [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(opts.output_len),
    ]


def bench_command(server: Server, input_len: int, concurrency: int, filename: str, opts) -> list[str]:
    return [
        *vllm_command(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--model",
        "bench",
        "--tokenizer",
        str(opts.model_dir),
        "--base-url",
        server.url,
        *prompt_args(input_len, opts),
        "--ignore-eos",
        "--num-prompts",
        str(max(opts.num_prompts, concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--num-warmups",
        str(opts.warmups * concurrency),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(opts.out),
        "--result-filename",
        filename,
        *([] if opts.temperature is None else ["--temperature", str(opts.temperature)]),
    ]


def bench_load(server: Server, input_len: int, concurrency: int, step: str, opts) -> None:
    """One `vllm bench serve` run; its result goes to server.results, a failure to server.errors."""
    load = f"input {input_len}, concurrency {concurrency}"
    if server.proc.poll() is not None:
        report_failure(server, f"server exited with {server.proc.returncode} before {load}", server.log)
        return
    print(f"[{server.name}] {load} ({step}): vllm bench serve ...", flush=True)
    stem = f"{server.name}-{input_len}-c{concurrency}"
    filename, log = f"{stem}.json", opts.out / f"bench-{stem}.log"
    started = time.time()
    try:
        done = subprocess.run(
            bench_command(server, input_len, concurrency, filename, opts),
            capture_output=True,
            text=True,
            timeout=opts.bench_timeout,
        )
        log.write_text(done.stdout + done.stderr)
        failure = f"vllm bench serve exited with {done.returncode} at {load}" if done.returncode else None
    except subprocess.TimeoutExpired:
        failure = f"vllm bench serve ran past {opts.bench_timeout:.0f} s at {load}"
        log.write_text(failure + "\n")
    if failure:
        report_failure(server, failure, log)
        return
    result = server.results[input_len, concurrency] = json.loads((opts.out / filename).read_text())
    row = ", ".join(f"{label} {result[key]:.1f}" for key, label in METRICS)
    print(f"[{server.name}] {load}: {row} ({time.time() - started:.0f} s)", flush=True)
    if result["failed"]:
        report_failure(
            server,
            f"{result['failed']} of {result['num_prompts']} requests failed at {load}; its numbers cover the others",
            log,
        )


def run_together(servers: list[Server], common: list[str], opts) -> None:
    """Start these servers at once (each with an equal share of the device memory), wait until all are
    healthy or failed, benchmark the healthy ones one after another, stop them all."""
    try:
        for server in servers:
            start_server(server, opts.gpu_memory_utilization / len(servers), common, opts)
        wait_until_healthy(servers, opts.startup_timeout)
        for server in [s for s in servers if not s.errors]:
            for i, (input_len, concurrency) in enumerate(opts.loads, 1):
                bench_load(server, input_len, concurrency, f"load {i}/{len(opts.loads)}", opts)
            for input_len in opts.input_lens if opts.greedy_tokens else ():
                greedy_tokens(server, input_len, opts)
    finally:
        for server in servers:
            stop_server(server)


@functools.cache  # one prompt per length, whichever server asks
def greedy_prompt(model_dir: Path, input_len: int) -> list[int]:
    """input_len random token ids of the checkpoint's vocabulary, the same for every server (seeded by the length)."""
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config.get("text_config", config)["vocab_size"]
    rng = random.Random(input_len)
    return [rng.randrange(vocab_size) for _ in range(input_len)]


def greedy_tokens(server: Server, input_len: int, opts) -> None:
    """--greedy-tokens greedy tokens of greedy_prompt with their top logprobs into server.greedy[input_len] (and
    greedy-NAME-LEN.json); a failure goes to server.errors."""
    if server.proc.poll() is not None:
        report_failure(server, f"server exited with {server.proc.returncode} before the greedy request", server.log)
        return
    print(f"[{server.name}] input {input_len}: {opts.greedy_tokens} greedy tokens ...", flush=True)
    body = {
        "model": "bench",
        "prompt": greedy_prompt(opts.model_dir, input_len),
        "max_tokens": opts.greedy_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": GREEDY_TOP,
        "return_tokens_as_token_ids": True,  # vLLM's: tokens as "token_id:ID"
    }
    started = time.time()
    try:
        logprobs = post_json(f"{server.url}/v1/completions", body, opts.bench_timeout)["choices"][0]["logprobs"]
        greedy = {
            "tokens": [token_id(token) for token in logprobs["tokens"]],
            "logprobs": logprobs["token_logprobs"],
            "top_logprobs": [{token_id(t): lp for t, lp in top.items()} for top in logprobs["top_logprobs"]],
        }
    except (OSError, KeyError, TypeError, ValueError) as e:  # urllib's errors are OSErrors
        report_failure(server, f"the greedy request at input {input_len} failed: {e!r}", server.log)
        return
    server.greedy[input_len] = greedy
    (opts.out / f"greedy-{server.name}-{input_len}.json").write_text(json.dumps(greedy))
    print(f"[{server.name}] input {input_len}: greedy tokens {greedy['tokens']} ({time.time() - started:.0f} s)")


def token_id(token: str) -> int:
    """The id of a token vLLM names "token_id:ID" (return_tokens_as_token_ids)."""
    return int(token.removeprefix("token_id:"))


# ------------------------------------------------------------------------------------------- report


def table(servers: list[Server], loads: list[tuple[int, int]]) -> str:
    base = servers[0]
    speculating = any(SPECULATION[0][0] in r for s in servers for r in s.results.values())
    speculation = SPECULATION if speculating else ()
    header = [label for _, label in METRICS] + [f"{label} {base.name} / this" for _, label in RATIOS]
    header += [label for _, label in speculation]
    lines = ["| input | concurrency | config | " + " | ".join(header) + " |", "|---|---|---|" + "---|" * len(header)]
    for load in loads:
        for server in servers:
            r = server.results.get(load)
            if r is None:
                cells = ["failed"] + ["-"] * (len(header) - 1)
            else:
                b = base.results.get(load)
                cells = [f"{r[key]:.1f}" for key, _ in METRICS]
                cells += [f"{b[key] / r[key]:.2f}" if b and r[key] else "-" for key, _ in RATIOS]
                cells += [f"{r[key]:.2f}" if key in r else "-" for key, _ in speculation]
            lines.append(f"| {load[0]} | {load[1]} | {server.name} | " + " | ".join(cells) + " |")
    errors = [f"- {s.name}: {e}" for s in servers for e in s.errors]
    return "\n".join(lines + (["", "Failures:", *errors] if errors else []))


def agreement(servers: list[Server], input_lens: list[int]) -> str:
    """Per input length and configuration after the first: the greedy tokens it shares with the first before they
    differ, and the logit gap there in the first's distribution (its token's logprob minus the other's)."""
    base = servers[0]
    lines = [
        f"Greedy tokens against {base.name} (--greedy-tokens; gap: {base.name}'s logprob of its token minus that "
        f"of the other's at the first divergence, '>' where that is not among its top {GREEDY_TOP}):",
        "",
        "| input | config | tokens equal before a divergence | gap |",
        "|---|---|---|---|",
    ]
    for input_len in input_lens:
        want = base.greedy.get(input_len)
        for server in servers[1:]:
            got = server.greedy.get(input_len)
            if want is None or got is None:
                lines.append(f"| {input_len} | {server.name} | no tokens | - |")
                continue
            pairs = list(zip(want["tokens"], got["tokens"]))
            same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
            if same == len(pairs):
                lines.append(f"| {input_len} | {server.name} | all {same} | - |")
                continue
            top, own = want["top_logprobs"][same], want["logprobs"][same]
            other = got["tokens"][same]
            gap = f"{own - top[other]:.3f}" if other in top else f"> {own - min(top.values()):.3f}"
            lines.append(f"| {input_len} | {server.name} | {same} of {len(pairs)} | {gap} |")
    return "\n".join(lines)


def bar_chart_svg(title: str, names: list[str], results: list[dict], colors: list[str]) -> str:
    """One panel per metric, one bar per configuration, values written above the bars."""
    width, height, top, bottom = 260, 230, 40, 50
    panels = []
    for p, (key, label) in enumerate(METRICS):
        values = [r[key] for r in results]
        peak = max(values) or 1.0
        bar = (width - 40) / len(values)
        items = [f'<text x="{width / 2}" y="20" text-anchor="middle" font-weight="bold">{label}</text>']
        for i, (name, value, color) in enumerate(zip(names, values, colors)):
            h = (height - top - bottom) * value / peak
            x, y = 20 + i * bar + bar * 0.1, height - bottom - h
            items += [
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar * 0.8:.1f}" height="{h:.1f}" fill="{color}"/>',
                f'<text x="{x + bar * 0.4:.1f}" y="{y - 4:.1f}" text-anchor="middle">{value:.1f}</text>',
                f'<text x="{x + bar * 0.4:.1f}" y="{height - bottom + 16}" text-anchor="middle" '
                f'font-size="10">{name}</text>',
            ]
        panels.append(f'<g transform="translate({p * width},20)">' + "".join(items) + "</g>")
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(METRICS)}" height="{height + 20}" '
        f'font-family="sans-serif" font-size="12"><text x="10" y="16" font-weight="bold">{title}</text>'
        + "".join(panels)
        + "</svg>\n"
    )


def plot(servers: list[Server], loads: list[tuple[int, int]], out: Path) -> list[Path]:
    """One chart per load (input length, concurrency) over the configurations measured at it (a
    configuration keeps its color)."""
    paths = []
    for load in loads:
        measured = [(i, s) for i, s in enumerate(servers) if load in s.results]
        if measured:
            paths.append(out / f"e2e-{load[0]}-c{load[1]}.svg")
            paths[-1].write_text(
                bar_chart_svg(
                    f"input {load[0]} tokens, concurrency {load[1]}",
                    [s.name for _, s in measured],
                    [s.results[load] for _, s in measured],
                    [COLORS[i % len(COLORS)] for i, _ in measured],
                )
            )
    return paths


# --------------------------------------------------------------------------------------------- main


def parse_args(argv):
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--input-lens", type=int, nargs="+", required=True)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per load (at least its concurrency)")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[4],
        help="concurrent requests of a load; several values: one load each, same servers",
    )
    parser.add_argument(
        "--warmups", type=int, default=1, help="unmeasured requests per concurrent request before each run (default 1)"
    )
    parser.add_argument(
        "--prompts",
        choices=("random", "repeated"),
        default="random",
        help="random token ids (vLLM's random dataset), or texts repeating a random piece (default random)",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME='ARGS'",
        help="a server configuration (repeatable); default: by the checkpoint's architecture",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="NAME",
        help="run only these of the configurations (e.g. --only dense: one more server's rows for an earlier run)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature of the requests (0: greedy); default: the server's (vLLM's 1.0 unless the "
        "checkpoint's generation_config sets one)",
    )
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="also serve each configuration with this vllm serve --speculative-config (named NAME+METHOD)",
    )
    parser.add_argument(
        "--greedy-tokens",
        type=int,
        default=0,
        metavar="N",
        help="after its loads, ask each server for N greedy tokens of one prompt per input length and compare them "
        "with the first configuration's (default 0: not asked)",
    )
    parser.add_argument("--dense-backend", default="FLASH_ATTN", help="backend of the dense (and dense-layer) runs")
    parser.add_argument(
        "--parallel-start",
        action="store_true",
        help="start every server at once, then benchmark them one after another",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="device memory share of the servers running at once, split evenly (default 0.9)",
    )
    parser.add_argument("--port", type=int, default=8123, help="port of the first server; the next ones count up")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--bench-timeout", type=float, default=1800, help="seconds per vllm bench serve run")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-e2e"))
    opts = parser.parse_args(argv)
    if not (opts.model_dir / "config.json").is_file():
        parser.error(f"{opts.model_dir} holds no config.json")
    if opts.prompts == "repeated" and importlib.util.find_spec("pandas") is None:
        parser.error(
            "--prompts repeated: vllm bench serve reads them (its custom dataset) with pandas: pip install pandas"
        )
    opts.loads = [(n, c) for n in opts.input_lens for c in opts.concurrency]  # benchmarked in this order
    return opts, common


def server_configs(opts: argparse.Namespace) -> dict[str, list[str]]:
    """The configurations to serve: --config's, else the checkpoint's defaults; only --only's names if given;
    with --speculative-config each followed by itself with it."""
    configs = {k: shlex.split(v) for k, v in (c.split("=", 1) for c in opts.config)}
    configs = configs or default_configs(opts.model_dir, opts.dense_backend)
    if unknown := [name for name in opts.only if name not in configs]:
        sys.exit(f"bench_e2e: --only names {', '.join(unknown)}; the configurations are {', '.join(configs)}")
    chosen = {name: args for name, args in configs.items() if name in opts.only or not opts.only}
    if opts.speculative_config is None:
        return chosen
    method = json.loads(opts.speculative_config).get("method", "spec")
    with_twins = {}
    for name, args in chosen.items():
        with_twins[name] = args
        with_twins[f"{name}+{method}"] = [*args, "--speculative-config", opts.speculative_config]
    return with_twins


def summary(servers: list[Server], opts: argparse.Namespace) -> str:
    """The table of these servers' loads (and their greedy tokens' agreement), written to OUT/summary.md."""
    report = table(servers, opts.loads)
    if opts.greedy_tokens and len(servers) > 1:
        report += "\n\n" + agreement(servers, opts.input_lens)
    (opts.out / "summary.md").write_text(report + "\n")
    return report


def main(argv=None):
    opts, common = parse_args(sys.argv[1:] if argv is None else argv)
    configs = server_configs(opts)
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.prompts == "repeated":
        for input_len in opts.input_lens:
            count = max(opts.num_prompts, *opts.concurrency)
            write_repeated_prompts(opts.model_dir, input_len, count, opts.out / f"prompts-{input_len}.jsonl")
    servers = [
        Server(name, args, opts.port + (i if opts.parallel_start else 0), opts.out / f"server-{name}.log")
        for i, (name, args) in enumerate(configs.items())
    ]
    finished: list[Server] = []
    report = ""
    for group in [servers] if opts.parallel_start else [[s] for s in servers]:
        run_together(group, common, opts)
        finished += group
        report = summary(finished, opts)  # after each group: a run stopped later keeps what it measured
    print(report)
    for path in plot(servers, opts.loads, opts.out):
        print(f"plot: {path}")
    return servers


if __name__ == "__main__":
    main()
