"""The end-to-end benchmark's model and orchestration, on CPU: serve/build_m3_model.py --preset
m3-attention; serve/bench_e2e.py's default configurations (checked with vLLM's own argument parser,
hf-override code and weight-loader check); its server orchestration (parallel start, a failing
server, a run stopped by SIGTERM, summary, charts) against a stand-in `vllm` that answers /health and
writes bench results.

    python3 -m pytest -q tests/test_bench_e2e.py
"""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from serve import bench_e2e
from serve.local_server import healthy
from tests.serving import ROOT, free_port

M3_CONTEXT = 131072 + 8192  # a 128K prompt plus outputs


def parsed_config(model_dir):
    from vllm.transformers_utils.config import get_config

    return get_config(str(model_dir), trust_remote_code=False)


def test_m3_attention_preset_has_m3s_attention_shapes_and_tiny_weights(m3_attention_model):
    from safetensors import safe_open

    from serve.build_m3_model import PRESETS, make_config
    from vllm_msa.config import MSAModelConfig

    text = parsed_config(m3_attention_model).get_text_config()
    assert type(text).__name__ in ("MiniMaxM3TextConfig", "MiniMaxM3VLTextConfig")
    assert text.max_position_embeddings >= M3_CONTEXT
    msa = MSAModelConfig.from_minimax_m3(text)
    production = type(text)(**make_config(**PRESETS["production"])["text_config"])  # the released M3's shapes
    assert msa.layer_shape(text) == MSAModelConfig.from_minimax_m3(production).layer_shape(production)
    assert msa.dense_layers == (0,) and msa.sparse_layers(text.num_hidden_layers) == [1, 2, 3]
    with safe_open(m3_attention_model / "model.safetensors", "pt") as f:
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118  (safe_open: keys(), no iteration)
    assert params < 100e6, params


def test_m3_layer_mix_preset_has_m3s_layers_with_m3_attentions_shapes(m3_attention_model):
    from serve.build_m3_model import PRESETS, make_config
    from vllm_msa.config import MSAModelConfig

    text_config_class = type(parsed_config(m3_attention_model).get_text_config())  # as this vLLM reads M3

    def text(preset):
        return text_config_class(**make_config(**PRESETS[preset])["text_config"])

    mix, production, attention = text("m3-layer-mix"), text("production"), text("m3-attention")
    msa = MSAModelConfig.from_minimax_m3(mix)
    assert msa.dense_layers == MSAModelConfig.from_minimax_m3(production).dense_layers == (0, 1, 2)
    assert msa.sparse_layers(mix.num_hidden_layers) == list(range(3, 60))
    assert msa.layer_shape(mix) == MSAModelConfig.from_minimax_m3(attention).layer_shape(attention)
    assert mix.hidden_size == attention.hidden_size
    long = text("m3-attention-1m")  # issue 18's 1M-token serving: M3's position limit, the same layers
    assert long.max_position_embeddings == 1048576 > attention.max_position_embeddings
    assert MSAModelConfig.from_minimax_m3(long).layer_shape(long) == msa.layer_shape(mix)


def engine_args(model_dir, args):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", str(model_dir), *args]))


def apply_hf_overrides(config, overrides):
    """vLLM's ModelConfig code for dict-valued --hf-overrides (ModelConfig itself needs CUDA for M3)."""
    from vllm.config import ModelConfig

    this = SimpleNamespace()
    this._update_nested = lambda target, updates: ModelConfig._update_nested(this, target, updates)
    ModelConfig._apply_dict_overrides(this, config, overrides)
    return config


def test_m3_default_configs_are_flash_msa_vllms_m3_and_all_dense_m3(m3_attention_model):
    from vllm_msa.config import MSAModelConfig

    configs = bench_e2e.default_configs(m3_attention_model, "FLASH_ATTN")
    assert list(configs) == ["FLASH_MSA", "FLASH_MSA-fp8-index", "MINIMAX_M3_SPARSE", "dense"]
    parsed = {name: engine_args(m3_attention_model, args) for name, args in configs.items()}
    assert {name: e.attention_backend for name, e in parsed.items()} == {
        "FLASH_MSA": "FLASH_MSA",
        "FLASH_MSA-fp8-index": "FLASH_MSA",
        "MINIMAX_M3_SPARSE": "FLASH_ATTN",
        "dense": "FLASH_ATTN",
    }
    assert {name: e.attention_config.indexer_kv_dtype for name, e in parsed.items()} == {
        "FLASH_MSA": "auto",
        "FLASH_MSA-fp8-index": "fp8",
        "MINIMAX_M3_SPARSE": "auto",
        "dense": "auto",
    }
    assert {e.block_size for e in parsed.values()} == {128}
    assert [e.load_format for e in parsed.values()] == ["auto", "auto", "auto", "dummy"]
    assert parsed["FLASH_MSA"].hf_overrides == parsed["MINIMAX_M3_SPARSE"].hf_overrides == {}

    from vllm_msa import compat

    config = parsed_config(m3_attention_model)
    before = compat.m3_sparse_fields(config.get_text_config())
    text = apply_hf_overrides(config, parsed["dense"].hf_overrides).get_text_config()
    after = compat.m3_sparse_fields(text)
    assert after["sparse_layers"] == [False] * 4 and {**after, "sparse_layers": None} == {
        **before,
        "sparse_layers": None,
    }
    assert MSAModelConfig.from_minimax_m3(text).dense_layers == (0, 1, 2, 3)  # every layer dense


def test_vllms_dense_m3_layer_refuses_index_weights_so_dense_runs_dummy_weights():
    from vllm.model_executor.layers.linear import QKVParallelLinear

    # vLLM's M3 load_weights maps index_q_proj onto qkv_proj with shard id "index_q"; a dense layer's
    # qkv_proj is a QKVParallelLinear. If this ever loads, the dense configuration can drop --load-format dummy.
    layer = QKVParallelLinear.__new__(QKVParallelLinear)  # the check reads only class-level shard names
    with pytest.raises(ValueError, match="got shard id index_q"):
        layer.validate_shard_id("index_q")


def test_flash_msa_default_configs_are_unchanged(demo_model):
    configs = bench_e2e.default_configs(demo_model, "CPU_ATTN")
    assert list(configs) == ["FLASH_MSA", "dense"]
    assert configs["FLASH_MSA"] == ["--attention-backend", "FLASH_MSA"]
    dense = engine_args(demo_model, configs["dense"])
    assert dense.attention_backend == "CPU_ATTN" and dense.hf_overrides["msa_config"]["dense_layers"] == [0, 1, 2, 3]


def test_only_keeps_the_named_configurations_and_refuses_unknown_names(demo_model):
    opts, _ = bench_e2e.parse_args([str(demo_model), "--input-lens", "64", "--only", "dense"])
    assert list(bench_e2e.server_configs(opts)) == ["dense"]
    opts, _ = bench_e2e.parse_args([str(demo_model), "--input-lens", "64", "--only", "dense", "FLASH"])
    with pytest.raises(SystemExit, match="--only names FLASH; the configurations are FLASH_MSA, dense"):
        bench_e2e.server_configs(opts)


def test_speculative_config_adds_a_speculating_twin_of_each_configuration_with_its_acceptance(demo_model):
    speculative = '{"method": "ngram", "num_speculative_tokens": 3}'
    opts, _ = bench_e2e.parse_args([str(demo_model), "--input-lens", "64", "--speculative-config", speculative])
    configs = bench_e2e.server_configs(opts)
    assert list(configs) == ["FLASH_MSA", "FLASH_MSA+ngram", "dense", "dense+ngram"]
    assert configs["FLASH_MSA+ngram"] == [*configs["FLASH_MSA"], "--speculative-config", speculative]
    assert engine_args(demo_model, configs["dense+ngram"]).speculative_config == json.loads(speculative)
    plain = {
        "mean_ttft_ms": 50.0,
        "mean_tpot_ms": 20.0,
        "median_itl_ms": 20.0,
        "p99_itl_ms": 30.0,
        "output_throughput": 50.0,
    }
    speculating = plain | {
        "mean_tpot_ms": 10.0,
        "spec_decode_acceptance_rate": 40.0,
        "spec_decode_acceptance_length": 2.2,
    }
    servers = [
        bench_e2e.Server(name, [], 0, Path("log"), results={(64, 4): result})
        for name, result in (("FLASH_MSA", plain), ("FLASH_MSA+ngram", speculating))
    ]
    summary = bench_e2e.table(servers, [(64, 4)])
    assert summary.splitlines()[0].endswith("| ITL p50 FLASH_MSA / this | accept % | accept len |")
    assert "| 64 | 4 | FLASH_MSA | 50.0 | 20.0 | 20.0 | 30.0 | 50.0 | 1.00 | 1.00 | 1.00 | - | - |" in summary
    twin = "| 64 | 4 | FLASH_MSA+ngram | 50.0 | 10.0 | 20.0 | 30.0 | 50.0 | 1.00 | 2.00 | 1.00 | 40.00 | 2.20 |"
    assert twin in summary


def test_repeated_prompts_repeat_a_piece_up_to_the_input_length(demo_model, tmp_path):
    from transformers import AutoTokenizer

    opts, _ = bench_e2e.parse_args([str(demo_model), "--input-lens", "1024", "--out", str(tmp_path)])
    opts.prompts = "repeated"  # parse_args wants pandas for it, which vllm bench needs and CI has not
    path = tmp_path / "prompts-1024.jsonl"
    bench_e2e.write_repeated_prompts(demo_model, 1024, 6, path)
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    assert len(prompts) == 6 and all(abs(len(tokenizer(p).input_ids) - 1024) <= 1 for p in prompts)
    for prompt in prompts:  # texts that repeat their first piece (of 4 to 300 tokens) at least 3 times
        period = next(n for n in range(1, len(prompt)) if prompt[n:] == prompt[:-n])
        assert period <= len(prompt) / 3
    command = bench_e2e.bench_command(bench_e2e.Server("A", [], 0, Path("log")), 1024, 4, "r.json", opts)
    assert command[command.index("--dataset-name") + 1 :][:3] == ["custom", "--dataset-path", str(path)]
    assert "--save-detailed" in command  # each request's TTFT and ITLs in the result JSON
    assert command[command.index("--num-warmups") + 1] == "4"  # --warmups 1 x concurrency 4: its batch sizes warm


STAND_IN_VLLM = """
import http.server, json, sys, time
args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
if args[0] == "serve":
    print("serve", json.dumps(args), flush=True)
    if "BROKEN" in args:
        sys.exit("ValueError: unknown attention backend BROKEN")
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def do_POST(self):  # greedy completions: the second server's third token differs, the first's second-best
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            second = int(opt("--port")) != PORT
            tokens = [len(body["prompt"]), 7, 9 if second else 8, 5][: body["max_tokens"]]
            top = [{f"token_id:{t}": -0.5, "token_id:9": -2.0} for t in tokens]
            logprobs = {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [-0.5] * len(tokens),
                        "top_logprobs": top}
            answer = json.dumps({"choices": [{"logprobs": logprobs}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        def log_message(self, *_):
            pass
    http.server.HTTPServer(("127.0.0.1", int(opt("--port"))), Health).serve_forever()
else:  # bench serve: TPOT = input length / 100 * (1 + server index)
    scale = 1 + int(opt("--base-url").rsplit(":", 1)[1]) - PORT
    n = int(opt("--random-input-len"))
    time.sleep(600 if n == HANGING_INPUT_LEN else 0)
    result = {"mean_ttft_ms": n / 10 * scale, "mean_tpot_ms": n / 100 * scale, "median_itl_ms": n / 200 * scale,
              "p99_itl_ms": n / 50 * scale, "output_throughput": 1000 / scale, "num_prompts": 4, "failed": 0}
    with open(f"{opt('--result-dir')}/{opt('--result-filename')}", "w") as f:
        json.dump(result, f)
"""


HANGING_INPUT_LEN = 999  # the stand-in's `vllm bench serve` of this input length never ends


@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch) -> tuple[int, Path]:
    """(the first server's port, the stand-in `vllm` executable), bench_e2e's vllm_command routed to it."""
    port = free_port()
    stand_in = tmp_path / "bin" / "vllm"
    stand_in.parent.mkdir()
    script = STAND_IN_VLLM.replace("PORT", str(port)).replace("HANGING_INPUT_LEN", str(HANGING_INPUT_LEN))
    stand_in.write_text(f"#!{sys.executable}\n{script}")
    stand_in.chmod(0o755)
    monkeypatch.setattr(bench_e2e, "vllm_command", lambda: [str(stand_in)])
    return port, stand_in


def test_parallel_start_benchmarks_every_healthy_server_and_reports_the_failed_one(
    demo_model, tmp_path, capsys, stand_in_vllm
):
    port, _ = stand_in_vllm
    out = tmp_path / "out"
    servers = bench_e2e.main(
        [
            str(demo_model),
            "--input-lens",
            "100",
            "200",
            "--concurrency",
            "1",
            "4",
            "--parallel-start",
            "--port",
            str(port),
            "--config",
            "A=--attention-backend FLASH_MSA",
            "--config",
            "B=--attention-backend X",
            "--config",
            "C=--attention-backend BROKEN",
            "--greedy-tokens",
            "4",
            "--out",
            str(out),
            "--",
            "--enforce-eager",
        ]
    )
    printed = capsys.readouterr().out
    a, b, c = servers
    assert [s.port for s in servers] == [port, port + 1, port + 2]
    assert a.results[200, 4]["mean_tpot_ms"] == 2.0 and b.results[200, 1]["mean_tpot_ms"] == 4.0 and not c.results
    assert c.errors == ["server exited with 1 before it was healthy (see server-C.log)"]
    assert "unknown attention backend BROKEN" in printed  # the log tail
    assert "[B] input 200, concurrency 4 (load 4/4): vllm bench serve" in printed
    for server in servers:  # each its share of the device; the extra args last
        argv = json.loads(server.log.read_text().split("serve ", 1)[1].splitlines()[0])
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.300" and argv[-1] == "--enforce-eager"
        assert argv[argv.index("--max-num-seqs") + 1] == "4"  # the largest concurrency
    summary = (out / "summary.md").read_text()
    assert "| 200 | 4 | B | 40.0 | 4.0 | 2.0 | 8.0 | 500.0 | 0.50 | 0.50 | 0.50 |" in summary
    assert "| 100 | 1 | C | failed |" in summary and "- C: server exited with 1" in summary
    assert sorted(p.name for p in out.glob("*.svg")) == [
        "e2e-100-c1.svg",
        "e2e-100-c4.svg",
        "e2e-200-c1.svg",
        "e2e-200-c4.svg",
    ]
    assert ">B</text>" in (out / "e2e-200-c4.svg").read_text()
    # the same greedy prompt for every server (its length its first token here); B's third token differs, by a
    # logit gap of 1.5 in A's distribution; C never started
    assert a.greedy[200]["tokens"] == [200, 7, 8, 5] and b.greedy[100]["tokens"] == [100, 7, 9, 5]
    assert bench_e2e.greedy_prompt(demo_model, 100) == bench_e2e.greedy_prompt(demo_model, 100)
    assert json.loads((out / "greedy-B-200.json").read_text())["tokens"] == [200, 7, 9, 5]
    assert "| 200 | B | 2 of 4 | 1.500 |" in summary and "| 100 | C | no tokens | - |" in summary


def test_a_run_stopped_after_its_first_server_keeps_that_servers_rows(demo_model, tmp_path, monkeypatch, stand_in_vllm):
    port, _ = stand_in_vllm
    run_together = bench_e2e.run_together
    groups = []

    def stopped_at_the_second(group, common, opts):  # as a timeout ends the benchmark during B's start
        groups.append([s.name for s in group])
        if len(groups) > 1:
            raise KeyboardInterrupt
        run_together(group, common, opts)

    monkeypatch.setattr(bench_e2e, "run_together", stopped_at_the_second)
    out = tmp_path / "out"
    argv = [str(demo_model), "--input-lens", "100", "--concurrency", "1", "--port", str(port), "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        bench_e2e.main([*argv, "--config", "A=--attention-backend FLASH_MSA", "--config", "B=--attention-backend X"])
    assert groups == [["A"], ["B"]]
    summary = (out / "summary.md").read_text()
    assert "| 100 | 1 | A | 10.0 | 1.0 | 0.5 | 2.0 | 1000.0 | 1.00 | 1.00 | 1.00 |" in summary


def test_a_benchmark_stopped_by_sigterm_stops_its_server(demo_model, tmp_path, stand_in_vllm):
    """As `timeout` stops a chain's step: the server (in its own session) must not outlive the benchmark and keep
    the port and device memory from the next step (2026-12-07 on the GPU: it did, and the next two steps failed).
    The benchmark runs in a process of its own, so it finds the stand-in on PATH."""
    port, stand_in = stand_in_vllm
    out = tmp_path / "out"
    argv = [str(demo_model), "--input-lens", str(HANGING_INPUT_LEN), "--concurrency", "1", "--port", str(port)]
    bench = subprocess.Popen(
        [sys.executable, "-m", "serve.bench_e2e", *argv, "--only", "FLASH_MSA", "--out", str(out)],
        cwd=ROOT,
        env=os.environ | {"PATH": f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in bench.stdout:  # until the hanging load has started
            if "(load 1/1): vllm bench serve" in line:
                break
        assert healthy(f"http://127.0.0.1:{port}")
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) == 128 + signal.SIGTERM
    finally:
        bench.kill()
    assert not healthy(f"http://127.0.0.1:{port}")
