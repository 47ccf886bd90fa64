"""Issue 19's pass-key model: the task, the training model against the served model's oracle, a CPU training
run that stops on its time budget, resumes and exports, and the trained checkpoint served with FLASH_MSA.

The training model (training/msa_model.py) must compute what FlashMSAForCausalLM serves: its logits on an
exported checkpoint equal tests/reference_model.py's (the oracle of the vLLM integration) with dense and
with MSA layers. The served test needs the trained checkpoint at models/needle-msa (skipped without it):
through serve/eval_needle.py, FLASH_MSA answers 2K-token prompts (16 blocks, top-4) right, sent as token ids
and as text, and the same weights with random index heads answer fewer of them. The trained checkpoint's
selections at M3's top-16 (training/trained_selections.py, for the benchmarks) are valid causal picks whose
neighbours agree more than random scores' do.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.problems import load_trained_selections, mean_union
from msa_kernels.shapes import M3_SHAPE
from serve import eval_needle
from tests.reference_model import ReferenceFlashMSA
from tests.serving import free_port
from training import trained_selections
from training.msa_model import (
    FlashMSAForCausalLM,
    dense_block_mass,
    distillation_queries,
    export_checkpoint,
    layer_shape,
    load_checkpoint,
)
from training.needle_task import (
    ANSWER,
    GRAMMAR_POOL,
    QUESTION,
    PassKeyTask,
    answer_is_correct,
    grammar_sentences,
    load_tokenizer,
)
from training.train_needle import BUDGET_STOPPED, NEEDLE_CONFIG, PRESETS
from vllm_msa.checkpoint import EOS

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "models" / "needle-msa"


@pytest.fixture(scope="module")
def task(demo_model):
    return PassKeyTask(load_tokenizer(demo_model), EOS)


@pytest.fixture(scope="module")
def exported(demo_model, tmp_path_factory):
    """A randomly initialised training model exported as a checkpoint, and the model loaded back from it."""
    out = export_checkpoint(FlashMSAForCausalLM(NEEDLE_CONFIG, seed=3), demo_model, tmp_path_factory.mktemp("x") / "m")
    return out, load_checkpoint(out)


@pytest.mark.parametrize("num_tokens", [200, 1000, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_has_its_length_key_at_depth_and_question(task, num_tokens, depth):
    prompt = task.prompt(num_tokens, depth, "40417", np.random.default_rng(num_tokens))
    assert len(prompt.prompt_ids) == num_tokens
    text = task.tokenizer.decode(prompt.prompt_ids)
    assert text.endswith(QUESTION) and text.count("The pass key is 40417. Remember it. 40417 is the pass key.") == 1
    filler = num_tokens - task.min_prompt_tokens()
    longest_sentence = 12  # tokens of the longest filler sentence, with room: the key sits at a sentence boundary
    assert abs(prompt.key_position - len(task.instruction) - depth * filler) <= longest_sentence
    assert task.tokenizer.decode(prompt.answer_ids[:-1]) == ANSWER.format(key="40417")
    assert prompt.answer_ids[-1] == EOS


def test_prompts_are_deterministic_and_bad_input_is_refused(task):
    first = task.training_sequences(7, 512, 3)
    again = task.training_sequences(7, 512, 3)
    other = task.training_sequences(8, 512, 3)
    assert all(np.array_equal(a, b) for a, b in zip(first, again)) and not np.array_equal(first[0], other[0])
    tokens, answer_mask = first
    assert tokens.shape == answer_mask.shape == (3, 512)
    for row, mask in zip(tokens, answer_mask):
        assert mask[-1] and row[-1] == EOS and 4 <= mask.sum() <= 7 and not mask[: 512 - mask.sum()].any()
    with pytest.raises(ValueError, match="needs at least"):
        task.prompt(20, 0.5, "12345", np.random.default_rng(0))
    with pytest.raises(ValueError, match="depth"):
        task.prompt(500, 1.5, "12345", np.random.default_rng(0))
    with pytest.raises(ValueError, match="5 digits"):
        task.prompt(500, 0.5, "1234", np.random.default_rng(0))


def test_trailing_tokens_move_the_answer_off_the_end(task):
    tokens, answer_mask = task.training_sequences(7, 512, 3, trailing=40)
    assert tokens.shape == answer_mask.shape == (3, 512)
    for row, mask in zip(tokens, answer_mask):
        end = 512 - 40
        assert row[end - 1] == EOS and mask[end - 1] and not mask[end:].any() and 4 <= mask.sum() <= 7
        assert list(row[end : end + len(task.instruction)]) == task.instruction  # the next document starts


def test_grammar_filler_and_distractor_numbers_keep_the_prompts_exact_and_the_key_findable(demo_model):
    """Issue 49's task: filler from GRAMMAR's sentences (thousands, not 20), and other 5-digit numbers in distractor
    sentences; the prompt still has its exact length, its key sentence at key_position, the question last."""
    task = PassKeyTask(load_tokenizer(demo_model), EOS, filler="grammar", distractors=3)
    tokenizer = task.tokenizer
    for depth in (0.0, 0.5, 1.0):
        sample = task.prompt(2000, depth, "27182", np.random.default_rng(int(depth * 10)))
        assert len(sample.prompt_ids) == 2000 and sample.prompt_ids[-len(task.question) :] == task.question
        key_sentence = task._key_sentence("27182")
        assert sample.prompt_ids[sample.key_position :][: len(key_sentence)] == key_sentence
        text = tokenizer.decode(sample.prompt_ids)
        numbers = re.findall(r"\b\d{5}\b", text)
        assert numbers.count("27182") == 2 and len(numbers) == 5, numbers  # the key twice, 3 distractors
        assert len(set(re.findall(r" The \w+ \w+ \w+ [^.]+\.", text))) > 40  # many distinct filler sentences
    assert len(set(grammar_sentences(GRAMMAR_POOL))) == GRAMMAR_POOL
    with pytest.raises(ValueError, match="filler 'lorem'"):
        PassKeyTask(tokenizer, EOS, filler="lorem")


def test_the_served_evaluation_takes_the_tasks_options_and_refuses_bad_ones(demo_model, capsys):
    opts = eval_needle.parse_args([str(demo_model), "--contexts", "1024", "--filler", "grammar", "--distractors", "3"])
    assert (opts.filler, opts.distractors) == ("grammar", 3)
    with pytest.raises(SystemExit):
        eval_needle.parse_args([str(demo_model), "--contexts", "1024", "--distractors", "-1"])
    assert "--distractors must be >= 0, not -1" in capsys.readouterr().err


def test_a_chat_prompt_is_what_the_chat_endpoint_gives_the_model(task, demo_model):
    """PassKeyTask.chat's ids equal the demo tokenizer's rendering of the prompt's text as one user message with the
    generation prompt (what vLLM's /v1/chat/completions tokenizes), the key moved by the template's head."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    sample = task.prompt(700, 0.4, "20481", np.random.default_rng(3))
    text = tokenizer.decode(sample.prompt_ids)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    chat = task.chat(sample)
    assert chat.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert chat.prompt_ids[chat.key_position :][: len(task._key_sentence("20481"))] == task._key_sentence("20481")


def test_chat_training_rows_end_their_prompt_with_the_template_and_plain_rows_keep_their_data(task):
    tokens, answer_mask = task.training_sequences(7, 512, 4, trailing=20, chat_share=1.0)
    end = 512 - 20
    for row, mask in zip(tokens, answer_mask):
        answer = int(mask.sum())
        before_answer = list(row[: end - answer])
        head, tail = len(task.chat_user), len(task.chat_assistant)
        assert before_answer[:head] == task.chat_user and before_answer[-tail:] == task.chat_assistant
        assert before_answer[-tail - len(task.question) : -tail] == task.question
        assert row[end - 1] == EOS and mask[end - 1] and not mask[end:].any()
    plain, plain_mask = task.training_sequences(7, 512, 4, trailing=20)
    again, again_mask = task.training_sequences(7, 512, 4, trailing=20, chat_share=0.0)
    assert np.array_equal(plain, again) and np.array_equal(plain_mask, again_mask)
    mixed = task.training_sequences(7, 512, 40, chat_share=0.5)[0]
    chat_rows = sum(list(row[: len(task.chat_user)]) == task.chat_user for row in mixed)
    assert 10 <= chat_rows <= 30
    with pytest.raises(ValueError, match="chat_share 1.5"):
        task.training_sequences(7, 512, 1, chat_share=1.5)


def test_distillation_reads_every_focus_query_and_the_strided_ones():
    positions, is_focus = distillation_queries(1024, 128, focus=(1000, 1010))
    assert positions.tolist() == sorted(positions.tolist()) and len(set(positions.tolist())) == len(positions)
    assert positions[is_focus].tolist() == list(range(1000, 1010))
    assert positions[~is_focus].tolist() == [p for p in range(1023, 127, -8) if not 1000 <= p < 1010][::-1]
    default, default_focus = distillation_queries(1024, 128)
    assert default[default_focus].tolist() == list(range(1024 - 32, 1024))
    first_block, _ = distillation_queries(200, 128, focus=(100, 300))  # clipped to past the first block
    assert first_block.min() == 128 and first_block.max() == 199


def test_phase_three_mixes_dense_rounds_and_the_curriculum_retires_short_contexts():
    dense, _, msa = PRESETS["h200"].phases
    kinds = {(msa.context(s), msa.attention(s)) for s in range(12)}
    assert kinds == {(c, a) for c in (2048, 4096, 8192) for a in ("msa", "dense")}
    assert [msa.attention(s) for s in range(6)] == ["msa"] * 3 + ["dense"] * 3
    assert dense.contexts(dense.steps - 1) == [1024, 2048, 4096, 8192, 16384]
    assert dense.contexts(0) == [256] and all(dense.attention(s) == "dense" for s in range(10))


def test_answer_is_correct():
    assert answer_is_correct(" 40417.", "40417") and answer_is_correct("40417", "40417")
    assert not answer_is_correct(" 404170", "40417")  # a sixth digit
    assert not answer_is_correct(" 4041", "40417") and not answer_is_correct(" the key", "40417")


@pytest.mark.parametrize("attention", ["dense", "msa"])
def test_training_model_computes_what_is_served(exported, task, attention):
    """Logits of the training model on its exported checkpoint = the served model's oracle, at 700 tokens
    (6 blocks of which top-4 are read: MSA is sparse there and differs from dense)."""
    model_dir, model = exported
    ids = task.prompt(700, 0.4, "27182", np.random.default_rng(1)).prompt_ids
    all_dense = {"dense_layers": list(range(NEEDLE_CONFIG["num_hidden_layers"]))}
    expected = ReferenceFlashMSA(model_dir, msa_overrides=all_dense if attention == "dense" else None).logits(ids)
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]), attention=attention)
        other, _ = model(torch.tensor([ids]), attention="msa" if attention == "dense" else "dense")
    torch.testing.assert_close(logits[0, -1], expected, rtol=1e-4, atol=1e-4)
    assert (other[0, -1] - expected).abs().max() > 1e-2


def test_dense_block_mass_is_the_attention_summed_per_index_head_and_block():
    """Against the attention probabilities written out: 300 queries over 3 blocks, 8 query heads, 4 index heads."""
    shape = layer_shape(NEEDLE_CONFIG)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 300, 32, generator=generator), torch.randn(2, 2, 300, 32, generator=generator)
    positions = torch.tensor([5, 130, 299])
    scores = q[:, :, positions] @ k.repeat_interleave(4, dim=1).transpose(-1, -2) / 32**0.5
    probs = scores.masked_fill(torch.arange(300) > positions[:, None], float("-inf")).softmax(-1)
    probs = torch.nn.functional.pad(probs, (0, 84))  # 3 whole blocks
    expected = probs.view(2, 4, 2, 3, 3, 128).sum((2, 5)) / 2
    mass = dense_block_mass(q[:, :, positions], k, shape, positions)
    torch.testing.assert_close(mass, expected)
    torch.testing.assert_close(mass.sum(-1), torch.ones(2, 4, 3))
    assert (mass[:, :, 0, 1:] == 0).all() and (mass[:, :, 1, 2] == 0).all()  # causal: no later block


def test_distillation_trains_the_index_branch_only(task):
    model = FlashMSAForCausalLM(NEEDLE_CONFIG, seed=3)
    tokens = torch.from_numpy(task.training_sequences(0, 384, 2)[0])
    _, kl = model(tokens, attention="dense", distill=True)
    assert kl > 0
    kl.backward()
    index = {id(p) for p in model.index_parameters()}
    assert len(index) == 4 * (NEEDLE_CONFIG["num_hidden_layers"] - 1)
    for name, param in model.named_parameters():
        has_grad = param.grad is not None and param.grad.abs().sum() > 0
        assert has_grad == (id(param) in index), name


ISSUE_49_DATA = ["--chat-share", "0.5", "--filler", "grammar", "--distractors", "2"]


def _train(demo_model, out: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "training.train_needle", "--tokenizer", str(demo_model), "--out", str(out)]
    return subprocess.run(
        [*command, "--preset", "cpu-smoke", "--device", "cpu", *ISSUE_49_DATA, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )


def test_cpu_smoke_training_stops_on_budget_resumes_and_exports(demo_model, task, tmp_path):
    """On issue 49's data (half the sequences in the chat format, grammar filler, 2 distractor numbers a prompt); a
    resume with other data is refused."""
    stopped = _train(demo_model, tmp_path, "--time-budget-s", "10")
    assert stopped.returncode == BUDGET_STOPPED, stopped.stdout + stopped.stderr
    # 2 s of training (the budget less the 8 s reserve) ends in phase 1 or, on a fast or idle machine, phase 2
    where = re.search(r"time budget: stopped at phase (\d) \((\w+)\) step (\d+)", stopped.stdout)
    assert where and where[1] in "12" and (tmp_path / "state.pt").is_file(), stopped.stdout
    other = _train(demo_model, tmp_path, "--chat-share", "0")  # the run's data must not change on resume
    assert other.returncode != 0 and "'chat_share': 0.5, 'filler': 'grammar', 'distractors': 2}, not" in other.stderr
    done = _train(demo_model, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resuming: phase {where[1]} ({where[2]}), step {where[3]}" in done.stdout
    for after in ("phase 1", "phase 2", "phase 3"):  # each evaluation in the run that finished its phase
        assert f"[eval after {after}] msa   pass-key accuracy by context  640: " in stopped.stdout + done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == {"dense": 4, "index": 2, "msa": 2} and len(summary["evaluations"]) == 3
    msa_means = [np.mean(list(e["msa"].values())) for e in summary["evaluations"]]
    best = max(i for i, m in enumerate(msa_means) if m == max(msa_means))  # the later phase on a tie
    assert summary["exported"]["after"] == f"phase {best + 1}"
    model_dir = tmp_path / "model"
    assert json.loads((model_dir / "config.json").read_text()) == NEEDLE_CONFIG
    ids = task.prompt(640, 0.5, "31415", np.random.default_rng(2)).prompt_ids
    with torch.no_grad():
        logits, _ = load_checkpoint(model_dir)(torch.tensor([ids]), attention="msa")
    torch.testing.assert_close(logits[0, -1], ReferenceFlashMSA(model_dir).logits(ids), rtol=1e-4, atol=1e-4)


def _with_random_index_heads(model_dir: Path, out: Path) -> Path:
    """A copy of model_dir whose index projections are seeded random weights (as the untrained demo's)."""
    shutil.copytree(model_dir, out)
    weights = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, weight in weights.items():
        if ".index_q_proj." in name or ".index_k_proj." in name:
            random = torch.randn(weight.shape, generator=generator) / weight.shape[1] ** 0.5
            weights[name] = random.to(weight.dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _served_accuracy(model_dir: Path, out: Path) -> dict[str, float]:
    """Share of 2048-token pass-key prompts (keys at depths 0.1-0.7: outside the forced last block) that
    `vllm serve --attention-backend FLASH_MSA` answers right, through serve/eval_needle.py, by endpoint: the
    prompts' token ids and their text on /v1/completions."""
    args = [str(model_dir), "--only", "FLASH_MSA", "--contexts", "2048", "--depths", "0.1", "0.3", "0.5", "0.7"]
    args += ["--endpoints", "ids", "text"]
    args += ["--samples", "1", "--concurrency", "2", "--out", str(out), "--port", str(free_port())]
    server_args = [
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        "1G",
        "--enforce-eager",
    ]  # eager: starts in half the time
    assert eval_needle.main([*args, "--", *server_args]) == 0
    accuracy = json.loads((out / "results.json").read_text())["configs"]["FLASH_MSA"]["accuracy"]
    return {endpoint: float(np.mean(list(cells["2048"].values()))) for endpoint, cells in accuracy.items()}


@pytest.mark.slow
@pytest.mark.skipif(not (TRAINED / "config.json").is_file(), reason="no trained checkpoint at models/needle-msa")
def test_served_trained_index_heads_find_the_key_random_ones_do_not(tmp_path):
    trained = _served_accuracy(TRAINED, tmp_path / "trained")
    random_heads = _served_accuracy(_with_random_index_heads(TRAINED, tmp_path / "random-index"), tmp_path / "random")
    assert trained == {"ids": 1.0, "text": 1.0}, trained
    assert random_heads["ids"] < 1.0 and random_heads["text"] < 1.0, random_heads


@pytest.mark.skipif(not (TRAINED / "config.json").is_file(), reason="no trained checkpoint at models/needle-msa")
def test_trained_selections_are_causal_top16_picks_whose_neighbours_agree_more_than_random(tmp_path):
    out = tmp_path / "selections.pt"
    assert trained_selections.main([str(TRAINED), "--contexts", "4096", "--out", str(out)]) == 0
    [(context, selected)] = load_trained_selections(str(out), M3_SHAPE).items()  # M3's Hi 4 and top-16
    own = torch.arange(context) // M3_SHAPE.block_size
    assert context == 4096 and (selected == own[:, None, None]).any(-1).all(), "each token's own block is picked"
    assert ((selected >= -1) & (selected <= own[:, None, None])).all(), "only causal blocks, -1 padding"
    picked = selected.sort(-1).values
    assert ((picked[..., 1:] != picked[..., :-1]) | (picked[..., 1:] < 0)).all(), "no block picked twice"
    assert (selected[-1] >= 0).all(), "the last token sees 32 blocks and picks 16"
    random = trained_selections.random_selection(context, M3_SHAPE)
    assert mean_union(selected, trained_selections.TILE_TOKENS) < mean_union(random, trained_selections.TILE_TOKENS)
