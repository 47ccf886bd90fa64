"""Pass-key retrieval through the real server: accuracy by context length x needle depth, FLASH_MSA and dense.

Owns issue 19's served evaluation. For each configuration, the end-to-end benchmark's for a
FlashMSAForCausalLM checkpoint (serve/bench_e2e.py's flash_msa_configs: `FLASH_MSA`, the checkpoint's
trained top-k; `dense`, the same weights with every layer dense on --dense-backend), the real `vllm serve
MODEL_DIR` starts on 127.0.0.1 (bench_e2e.start_server), gets --samples pass-key prompts per (context,
depth) cell on each of --endpoints (greedy, max_tokens MAX_TOKENS, --concurrency at a time), and stops:
    ids    the prompt's token ids on /v1/completions (exactly the tokens training built)
    text   the prompt's text on /v1/completions, tokenized by the server as a typed prompt is
    chat   the prompt's text as one user message on /v1/chat/completions (the checkpoint's chat template)
The prompts are training/needle_task.py's (--filler, --distractors: its options; the defaults are the shipped
model's task), the same for every configuration (seeded by cell); an answer
is right when the completion starts with exactly the key's digits (needle_task.answer_is_correct), a chat
reply when its first number is exactly the key.

    python serve/eval_needle.py MODEL_DIR [--contexts 1024 2048 4096 8192 16384 32768] [--depths 0 0.25 0.5 0.75 1]
        [--samples 4] [--endpoints ids text chat] [--filler fixed] [--distractors 0] [--only FLASH_MSA dense]
        [--dense-backend FLASH_ATTN] [--concurrency 4] [--port 8123] [--gpu-memory-utilization 0.9]
        [--out results/needle] [-- extra args for every server]

--out gets summary.md (per configuration and endpoint a context x depth table, FLASH_MSA minus dense per
context, the command), results.json (every cell, the command, each server's arguments and errors),
needle-NAME-ENDPOINT.svg (a heat map per configuration and endpoint) and the server logs. Contexts need
--max-model-len = the longest + MAX_TOKENS + bench_e2e.PROMPT_SLACK within the checkpoint's
max_position_embeddings.

On one H200, the trained checkpoint (dev/gpu/README.md stages vLLM there):

    python3 serve/eval_needle.py models/needle-msa --contexts 1024 2048 4096 8192 16384 32768 --samples 8 \\
        --out $OUT/needle
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a script
from serve.bench_e2e import (
    PROMPT_SLACK,
    Server,
    flash_msa_configs,
    start_server,
    stop_server,
    wait_until_healthy,
)
from serve.local_server import post_json
from training.needle_task import FILLERS, PassKeyPrompt, PassKeyTask, answer_is_correct, load_tokenizer, random_key
from vllm_msa.checkpoint import EOS

MAX_TOKENS = 8  # " NNNNN." is 3-4 tokens, then EOS
START_TIMEOUT_S = 1200
REQUEST_TIMEOUT_S = 1800


def cell_prompts(task: PassKeyTask, context: int, depth: float, samples: int):
    """The cell's prompts: the same for every configuration and run."""
    rng = np.random.default_rng([context, round(depth * 1000), samples])
    return [task.prompt(context, depth, random_key(rng), rng) for _ in range(samples)]


ENDPOINTS = ("ids", "text", "chat")


def ask(url: str, endpoint: str, prompt: PassKeyPrompt, tokenizer) -> str:
    """The server's greedy answer to a pass-key prompt sent the endpoint's way (ENDPOINTS)."""
    body: dict = {"model": "bench", "max_tokens": MAX_TOKENS, "temperature": 0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": tokenizer.decode(prompt.prompt_ids)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt.prompt_ids if endpoint == "ids" else tokenizer.decode(prompt.prompt_ids)
        path = "/v1/completions"
    choice = post_json(f"{url}{path}", body, REQUEST_TIMEOUT_S)["choices"][0]
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]


def is_right(endpoint: str, answer: str, key: str) -> bool:
    """A completion starts with exactly the key's digits; a chat reply's first number is exactly the key."""
    if endpoint == "chat":
        number = re.search(r"\d+", answer or "")
        return number is not None and number.group() == key
    return answer_is_correct(answer, key)


def evaluate_server(server: Server, task: PassKeyTask, opts) -> dict[str, dict[str, dict[str, float]]]:
    """Accuracy {endpoint: {context: {depth: share right}}} of one healthy server; a failed request stops it."""
    accuracy: dict[str, dict[str, dict[str, float]]] = {endpoint: {} for endpoint in opts.endpoints}
    with ThreadPoolExecutor(opts.concurrency) as pool:
        for context in opts.contexts:
            prompts_by_depth = {depth: cell_prompts(task, context, depth, opts.samples) for depth in opts.depths}
            for endpoint in opts.endpoints:
                started, row = time.monotonic(), {}
                for depth, prompts in prompts_by_depth.items():
                    answers = list(pool.map(partial(ask, server.url, endpoint, tokenizer=task.tokenizer), prompts))
                    right = [is_right(endpoint, a, p.key) for a, p in zip(answers, prompts)]
                    row[f"{depth:g}"] = sum(right) / len(prompts)
                    wrong = [(p.key, a) for a, p, ok in zip(answers, prompts, right) if not ok]
                    if wrong:
                        where = f"[{server.name} {endpoint}] {context} depth {depth:g}"
                        print(f"{where}: wrong (key, answer): {wrong}", flush=True)
                accuracy[endpoint][str(context)] = row
                cells = "  ".join(f"{d}: {a:.2f}" for d, a in row.items())
                elapsed = time.monotonic() - started
                print(f"[{server.name} {endpoint}] {context} tokens  {cells}  ({elapsed:.0f} s)", flush=True)
    return accuracy


def color(accuracy: float) -> str:
    """Red (0) through yellow to green (1)."""
    red, green = (255, round(510 * accuracy)) if accuracy < 0.5 else (round(510 * (1 - accuracy)), 200)
    return f"rgb({red},{green},80)"


def heat_map_svg(title: str, accuracy: dict[str, dict[str, float]], contexts: list[int], depths: list[str]) -> str:
    cell_w, cell_h, left, top = 70, 32, 110, 50
    width, height = left + cell_w * len(contexts) + 20, top + cell_h * len(depths) + 50
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
        f'<text x="{width / 2}" y="22" font-size="15" text-anchor="middle">{title}</text>',
        f'<text x="14" y="{top + cell_h * len(depths) / 2}" font-size="12" '
        f'transform="rotate(-90 14 {top + cell_h * len(depths) / 2})" text-anchor="middle">needle depth</text>',
        f'<text x="{left + cell_w * len(contexts) / 2}" y="{height - 8}" font-size="12" '
        'text-anchor="middle">context (tokens)</text>',
    ]
    for row, depth in enumerate(depths):
        y = top + row * cell_h
        parts.append(f'<text x="{left - 8}" y="{y + cell_h / 2 + 4}" font-size="12" text-anchor="end">{depth}</text>')
        for col, context in enumerate(contexts):
            x, value = left + col * cell_w, accuracy.get(str(context), {}).get(depth)
            fill, label = ("#dddddd", "n/a") if value is None else (color(value), f"{value:.2f}")
            parts.append(f'<rect x="{x}" y="{y}" width="{cell_w}" height="{cell_h}" fill="{fill}" stroke="white"/>')
            center_x, center_y = x + cell_w / 2, y + cell_h / 2 + 4
            parts.append(f'<text x="{center_x}" y="{center_y}" font-size="12" text-anchor="middle">{label}</text>')
    for col, context in enumerate(contexts):
        x = left + col * cell_w + cell_w / 2
        y = top + cell_h * len(depths) + 16
        parts.append(f'<text x="{x}" y="{y}" font-size="12" text-anchor="middle">{context}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summary_markdown(results: dict, opts) -> str:
    depths = [f"{d:g}" for d in opts.depths]
    lines = [
        f"# Pass-key retrieval through the server: {opts.model_dir.name}",
        "",
        f"    {results['command']}",
        "",
        f"{opts.samples} prompts per cell (context x needle depth) and endpoint, greedy, max_tokens {MAX_TOKENS}; "
        "share of completions that start with exactly the key (chat: replies whose first number is the key). "
        "Endpoints: ids = token ids on /v1/completions, text = the prompt's text there, chat = the text as a user "
        "message on /v1/chat/completions.",
    ]
    for name, config in results["configs"].items():
        for endpoint in opts.endpoints:
            accuracy = config["accuracy"].get(endpoint, {})
            lines += ["", f"## {name}, {endpoint}: `{shlex.join(config['args'])}`", ""]
            lines += ["| depth | " + " | ".join(str(c) for c in opts.contexts) + " |"]
            lines += ["|---" * (len(opts.contexts) + 1) + "|"]
            for depth in [*depths, "mean"]:
                cells = []
                for context in opts.contexts:
                    row = accuracy.get(str(context), {})
                    value = mean(row.get(d) for d in depths) if depth == "mean" else row.get(depth)
                    cells.append("n/a" if value is None else f"{value:.2f}")
                lines.append(f"| {depth} | " + " | ".join(cells) + " |")
        lines += [f"\nErrors: {'; '.join(config['errors'])}"] if config["errors"] else []
    if {"FLASH_MSA", "dense"} <= results["configs"].keys():
        lines += ["", "## FLASH_MSA minus dense, mean over depths (goal: within 0.02 where dense >= 0.90)", ""]
        lines += ["| endpoint | context | dense | FLASH_MSA | difference |", "|---|---|---|---|---|"]
        for endpoint in opts.endpoints:
            msa = results["configs"]["FLASH_MSA"]["accuracy"].get(endpoint, {})
            dense = results["configs"]["dense"]["accuracy"].get(endpoint, {})
            for context in opts.contexts:
                d = mean(dense.get(str(context), {}).values())
                m = mean(msa.get(str(context), {}).values())
                if d is not None and m is not None:
                    lines.append(f"| {endpoint} | {context} | {d:.2f} | {m:.2f} | {m - d:+.2f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a FlashMSAForCausalLM checkpoint (e.g. models/needle-msa)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--samples", type=int, default=4, help="prompts per (context, depth) cell")
    parser.add_argument(
        "--endpoints", nargs="+", choices=ENDPOINTS, default=list(ENDPOINTS), help="how the prompts are sent"
    )
    parser.add_argument("--filler", choices=FILLERS, default="fixed", help="the prompts' filler (needle_task)")
    parser.add_argument("--distractors", type=int, default=0, help="sentences with other numbers in each prompt")
    parser.add_argument("--only", nargs="+", help="only these configurations (FLASH_MSA, dense)")
    parser.add_argument("--dense-backend", help="backend of `dense` (default: FLASH_ATTN on CUDA, else FLASH_MSA)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=Path("results/needle"))
    opts = parser.parse_args(argv)
    opts.extra = extra
    config_path = opts.model_dir / "config.json"
    if not config_path.is_file():
        parser.error(f"{config_path} not found")
    opts.config = json.loads(config_path.read_text())
    if min(opts.samples, opts.concurrency) < 1 or not all(0 <= d <= 1 for d in opts.depths):
        parser.error("--samples and --concurrency must be >= 1, --depths within [0, 1]")
    if opts.distractors < 0:
        parser.error(f"--distractors must be >= 0, not {opts.distractors}")
    longest = max(opts.contexts) + MAX_TOKENS + PROMPT_SLACK
    if longest > opts.config["max_position_embeddings"]:
        parser.error(
            f"--contexts up to {max(opts.contexts)} need --max-model-len {longest}, beyond the checkpoint's "
            f"max_position_embeddings {opts.config['max_position_embeddings']}"
        )
    if opts.dense_backend is None:
        import torch

        opts.dense_backend = "FLASH_ATTN" if torch.cuda.is_available() else "FLASH_MSA"
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    configs = flash_msa_configs(opts.config, opts.dense_backend)
    unknown = set(opts.only or []) - configs.keys()
    if unknown:
        sys.exit(f"--only: unknown configurations {sorted(unknown)}; there are {sorted(configs)}")
    configs = {name: args for name, args in configs.items() if not opts.only or name in opts.only}
    opts.out.mkdir(parents=True, exist_ok=True)
    task = PassKeyTask(load_tokenizer(opts.model_dir), EOS, opts.filler, opts.distractors)
    command = shlex.join(["python", "serve/eval_needle.py", *(sys.argv[1:] if argv is None else argv)])
    results = {
        "command": command,
        "model": str(opts.model_dir),
        "samples": opts.samples,
        "endpoints": opts.endpoints,
        "task": {"filler": opts.filler, "distractors": opts.distractors},
        "configs": {},
    }
    for offset, (name, args) in enumerate(configs.items()):
        server = Server(name, args, opts.port + offset, opts.out / f"server-{name}.log")
        start_server(server, opts.gpu_memory_utilization, opts.extra, bench_opts(opts))
        try:
            wait_until_healthy([server], START_TIMEOUT_S)
            accuracy = evaluate_server(server, task, opts) if not server.errors else {}
        except OSError as e:  # a request failed: the server died or timed out
            server.errors.append(f"request failed: {e}")
            accuracy = {}
        finally:
            stop_server(server)
        results["configs"][name] = {"args": args + opts.extra, "accuracy": accuracy, "errors": server.errors}
        depths = [f"{d:g}" for d in opts.depths]
        for endpoint in opts.endpoints:
            title = f"{opts.model_dir.name}: {name}, {endpoint}, pass-key accuracy"
            svg = heat_map_svg(title, accuracy.get(endpoint, {}), opts.contexts, depths)
            (opts.out / f"needle-{name}-{endpoint}.svg").write_text(svg)
    (opts.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (opts.out / "summary.md").write_text(summary_markdown(results, opts))
    print(f"wrote {opts.out}/summary.md, results.json and the heat maps", flush=True)
    return 1 if any(c["errors"] for c in results["configs"].values()) else 0


def bench_opts(opts) -> argparse.Namespace:
    """The fields bench_e2e.start_server reads: the model, request lengths and requests in flight."""
    return argparse.Namespace(
        model_dir=opts.model_dir, input_lens=opts.contexts, output_len=MAX_TOKENS, concurrency=[opts.concurrency]
    )


if __name__ == "__main__":
    sys.exit(main())
