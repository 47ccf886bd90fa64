"""End-to-end serving benchmark: one checkpoint served several ways, `vllm bench serve` against each.

For every server configuration it starts the real `vllm serve MODEL_DIR <config args>` on 127.0.0.1,
waits for /health, runs `vllm bench serve` (random dataset, fixed input and output lengths, bounded
concurrency) once per input length, stops the server, and prints TTFT, TPOT and output throughput
with each configuration's TPOT ratio to the first, and a bar chart per input length (matplotlib).
Raw results (vllm bench JSON), summary.md, the plots and the server logs go to --out.

    python serve/bench_e2e.py MODEL_DIR --input-lens 8192 32768 131072 [--output-len 128]
        [--num-prompts 16] [--concurrency 4] [--config NAME='vllm serve args' ...] [--out DIR]
        [-- extra args for every server]

Default configurations for an MSA checkpoint (FlashMSAForCausalLM): `FLASH_MSA` and `dense`, the
same weights with every layer dense (msa_config.dense_layers = all layers) on --dense-backend.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

METRICS = (("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"), ("output_throughput", "out tok/s"))


def default_configs(model_dir: Path, dense_backend: str) -> dict[str, list[str]]:
    config = json.loads((model_dir / "config.json").read_text())
    all_dense = {**config["msa_config"], "dense_layers": list(range(config["num_hidden_layers"]))}
    return {
        "FLASH_MSA": ["--attention-backend", "FLASH_MSA"],
        "dense": ["--attention-backend", dense_backend, "--hf-overrides", json.dumps({"msa_config": all_dense})],
    }


def vllm_command() -> list[str]:
    exe = shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def wait_healthy(port: int, server: subprocess.Popen, timeout_s: float, log: Path) -> float:
    start = time.time()
    while time.time() - start < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return time.time() - start
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; see {log}")


def run_config(name, args, common, opts, out: Path) -> dict[int, dict]:
    log = out / f"server-{name}.log"
    max_len = max(opts.input_lens) + opts.output_len
    cmd = [*vllm_command(), "serve", str(opts.model_dir), "--served-model-name", "bench", "--host", "127.0.0.1",
           "--port", str(opts.port), "--max-model-len", str(max_len), *args, *common]
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    with open(log, "w") as log_file:
        server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            print(f"[{name}] healthy after {wait_healthy(opts.port, server, opts.startup_timeout, log):.0f} s", flush=True)
            results = {}
            for input_len in opts.input_lens:
                filename = f"{name}-{input_len}.json"
                bench = [*vllm_command(), "bench", "serve", "--backend", "vllm", "--model", "bench",
                         "--tokenizer", str(opts.model_dir), "--base-url", f"http://127.0.0.1:{opts.port}",
                         "--dataset-name", "random", "--random-input-len", str(input_len),
                         "--random-output-len", str(opts.output_len), "--ignore-eos",
                         "--num-prompts", str(opts.num_prompts), "--max-concurrency", str(opts.concurrency),
                         "--save-result", "--result-dir", str(out), "--result-filename", filename]
                started = time.time()
                done = subprocess.run(bench, capture_output=True, text=True)
                (out / f"bench-{name}-{input_len}.log").write_text(done.stdout + done.stderr)
                if done.returncode != 0:
                    raise RuntimeError(f"vllm bench serve failed for {name} at {input_len}: see {out}")
                results[input_len] = json.loads((out / filename).read_text())
                row = ", ".join(f"{label} {results[input_len][key]:.1f}" for key, label in METRICS)
                print(f"[{name}] input {input_len}: {row} ({time.time() - started:.0f} s)", flush=True)
            return results
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()


def table(all_results: dict[str, dict[int, dict]], input_lens) -> str:
    names = list(all_results)
    base = names[0]
    lines = ["| input | config | " + " | ".join(label for _, label in METRICS) + f" | TPOT vs {base} |",
             "|---|---|" + "---|" * (len(METRICS) + 1)]
    for input_len in input_lens:
        for name in names:
            r = all_results[name][input_len]
            ratio = r["mean_tpot_ms"] / all_results[base][input_len]["mean_tpot_ms"]
            cells = " | ".join(f"{r[key]:.1f}" for key, _ in METRICS)
            lines.append(f"| {input_len} | {name} | {cells} | {ratio:.2f}x |")
    return "\n".join(lines)


def plot(all_results: dict[str, dict[int, dict]], input_lens, out: Path) -> list[Path]:
    """One figure per input length: TTFT, TPOT and output throughput of each configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", flush=True)
        return []
    names, paths = list(all_results), []
    for input_len in input_lens:
        fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.2))
        for ax, (key, label) in zip(axes, METRICS):
            ax.bar(names, [all_results[n][input_len][key] for n in names], color="C0")
            ax.set_title(label)
        fig.suptitle(f"input {input_len} tokens")
        fig.tight_layout()
        paths.append(out / f"e2e-{input_len}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--input-lens", type=int, nargs="+", required=True)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--config", action="append", default=[], metavar="NAME='ARGS'",
                        help="a server configuration (repeatable); default: FLASH_MSA and dense")
    parser.add_argument("--dense-backend", default="FLASH_ATTN", help="backend of the dense configuration")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-e2e"))
    opts = parser.parse_args(argv)
    if not (opts.model_dir / "config.json").is_file():
        parser.error(f"{opts.model_dir} holds no config.json")
    configs = dict(c.split("=", 1) for c in opts.config)
    configs = {k: shlex.split(v) for k, v in configs.items()} or default_configs(opts.model_dir, opts.dense_backend)
    opts.out.mkdir(parents=True, exist_ok=True)
    results = {name: run_config(name, args, common, opts, opts.out) for name, args in configs.items()}
    report = table(results, opts.input_lens)
    (opts.out / "summary.md").write_text(report + "\n")
    print(report)
    for path in plot(results, opts.input_lens, opts.out):
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
