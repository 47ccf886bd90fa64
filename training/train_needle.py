"""Train issue 19's pass-key FlashMSAForCausalLM with MSA in three phases, then export it as a checkpoint.

    python -m training.train_needle --tokenizer DIR --out DIR --preset {h200,cpu-smoke} [--time-budget-s S]
        [--fit-time] [--device cpu|cuda] [--eval-samples N] [--seed N] [--chat-share F] [--filler grammar]
        [--distractors N]

The model is the demo checkpoint's shape (serve/build_demo_model.py: 4 layers, hidden 256, Hq 8, Hkv 2,
Hi 4, Hki 1, Dp 32, top-4 of 128-token blocks, layer 0 dense; 4.45M parameters) with a 64K-token
max_position_embeddings, on the demo's tokenizer (--tokenizer: a checkpoint directory with tokenizer.json).
Its task is training/needle_task.py's. Each step trains on tokens_per_step tokens of sequences of one
context length (batch = tokens_per_step / context):

  phase 1 "dense"  all weights, dense attention; contexts join as the phase goes (the preset's curriculum,
                   up to 16K) and steps take the last `window` joined ones in turn (the short contexts,
                   learnt first, retire and the long ones get the steps); loss = CE of the answer tokens +
                   LM_WEIGHT x CE of the other tokens.
  phase 2 "index"  only the index branch (index_{q,k}_proj, index_{q,k}_norm; all else frozen), by
                   distillation towards the dense attention's block mass (training/msa_model.py), every
                   query of the question and answer counting as much as the strided filler queries.
  phase 3 "msa"    all weights, gently (a low learning rate): phase 1's loss + the distillation loss, with
                   MSA attention on, except every `dense_every`-th round of the contexts, which is dense
                   (the weights must stay good for dense attention: the evaluation compares the two on
                   the same weights); the index heads follow the attention as it adapts.

A sequence is a pass-key prompt and its answer, then 0-127 tokens of the next document (random per step):
the answer sits anywhere in its 128-token block, as it does for the evaluation and the server. Issue 49's data
(defaults: the shipped model's): --chat-share F puts that share of the sequences in the chat format, the prompt as
the one user message of the demo's chat template (needle_task.PassKeyTask.chat), as /v1/chat/completions sends it;
--filler grammar draws the filler from needle_task.GRAMMAR's sentences instead of 20 fixed ones; --distractors N
puts N sentences with other 5-digit numbers in every prompt. The in-training evaluation asks the same task (plain
text).

After each phase the pass-key accuracy at the preset's evaluation contexts is printed for dense and MSA
attention (--eval-samples prompts per context at evenly spaced depths; a prompt is right when greedy
decoding gives exactly the answer, i.e. the argmax at every answer position, teacher-forced, is the
answer's token). Progress lines every LOG_EVERY_S: step, contexts, losses, tokens/s, elapsed seconds.

Resumable: OUT/state.pt (phase, step, step counts, model, optimizer, evaluations, the best weights) is
written every SAVE_EVERY_S, after each phase and evaluation, and when --time-budget-s stops the run (exit
code 3; the same command continues where it stopped). --fit-time (fresh runs only) times a few steps of
every kind of step (phase, attention, context) and an evaluation (a second one: the first warms up) at
start, then scales all phases' step counts by one factor so the whole run fits --time-budget-s (the
measured times x FIT_SAFETY; at each later phase's start the remaining phases shrink again if the finished
ones ran slower than measured), and the last phase ends early, rather than stopping the run, when only
its evaluation and the export still fit.

The exported weights are those of the evaluated phase with the best mean MSA accuracy over the evaluation
contexts (the later phase on a tie): when phase 3 lowers it below phase 2's, phase 2's weights are
exported, and the log and summary.json say so. At the end OUT/model is the checkpoint
(msa_model.export_checkpoint: config.json, generation_config.json, bf16 model.safetensors, the tokenizer
files) and OUT/summary.json the evaluations, the exported phase, step counts and seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.msa_model import FlashMSAForCausalLM, export_checkpoint
from training.needle_task import FILLERS, PassKeyTask, load_tokenizer, random_key
from vllm_msa.checkpoint import EOS, make_config

NEEDLE_CONFIG = make_config(max_position_embeddings=65536)  # rope_theta 10000 as trained; 16K contexts trained
LM_WEIGHT = 0.2  # weight of the filler's next-token loss beside the answer's
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
LOG_EVERY_S = 10.0
SAVE_EVERY_S = 60.0
FIT_SAFETY = 1.15  # measured step and evaluation times x this when fitting the budget (first H200 run: the
# phases ran x1.04, x1.11 and x1.14 their measured step times)
RESERVE_S = 8.0  # kept free at the end of a budget: saving the state, exporting the checkpoint
BUDGET_STOPPED = 3  # exit code: the time budget stopped the run, the same command continues


@dataclass(frozen=True)
class Phase:
    name: str  # "dense", "index" or "msa"
    steps: int
    curriculum: tuple[tuple[int, float], ...]  # (context, fraction of the phase's steps from which it trains)
    lr: float
    warmup_steps: int  # linear warm-up over min(warmup_steps, steps / 10), then cosine decay to a tenth
    window: int = 0  # steps take the last `window` joined contexts in turn; 0: all joined ones
    dense_every: int = 0  # phase "msa": every dense_every-th round of its contexts trains with dense attention

    def contexts(self, step: int) -> list[int]:
        """The contexts that steps take in turn at `step`: the last `window` joined by then."""
        joined = [c for c, start in self.curriculum if step >= start * self.steps]
        return joined[-self.window :] if self.window else joined

    def context(self, step: int) -> int:
        """The context `step` trains on."""
        contexts = self.contexts(step)
        return contexts[step % len(contexts)]

    def attention(self, step: int) -> str:
        """The attention of `step`'s forward pass: "msa" in phase "msa" except its dense rounds (a round:
        one step of each context), else "dense"."""
        if self.name != "msa":
            return "dense"
        rounds = step // len(self.contexts(step))
        return "dense" if self.dense_every and rounds % self.dense_every == self.dense_every - 1 else "msa"

    def attentions(self) -> tuple[str, ...]:
        """The attentions of the phase's steps."""
        if self.name != "msa":
            return ("dense",)
        return ("msa", "dense") if self.dense_every else ("msa",)


@dataclass(frozen=True)
class Preset:
    tokens_per_step: int
    phases: tuple[Phase, ...]
    eval_contexts: tuple[int, ...]
    eval_samples: int


def _joined_at_once(*contexts: int) -> tuple[tuple[int, float], ...]:
    return tuple((c, 0.0) for c in contexts)


PRESETS = {
    # One H200 in ~450 s: --fit-time scales these step counts by one factor (about 1 at BUDGET=450). Measured
    # there (ms per 65,536-token step): dense 256-4K ~35, 8K 45, 16K 63; index 2K-16K 42-93; MSA 2K 111,
    # 4K 161, 8K 273. Phase 1 ~200 s (8K from 0.47 of it, 16K from 0.62, five contexts in turn: ~350
    # steps at 16K, ~500 at 8K), phase 2 ~45 s, phase 3 ~95 s (lr 5e-5, 30 warm-up steps, MSA and dense
    # rounds in turn).
    "h200": Preset(
        tokens_per_step=65536,
        phases=(
            Phase(
                "dense",
                5000,
                ((256, 0.0), (512, 0.06), (1024, 0.12), (2048, 0.2), (4096, 0.32), (8192, 0.47), (16384, 0.62)),
                1e-3,
                warmup_steps=100,
                window=5,
            ),
            Phase("index", 700, _joined_at_once(2048, 4096, 8192, 16384), 1e-3, warmup_steps=100),
            Phase("msa", 800, _joined_at_once(2048, 4096, 8192), 5e-5, warmup_steps=30, dense_every=2),
        ),
        eval_contexts=(2048, 4096, 8192, 16384),
        eval_samples=32,
    ),
    # A minute on two CPU cores: every code path; 640-token contexts hold 5 blocks, more than top-4: sparse.
    "cpu-smoke": Preset(
        tokens_per_step=1024,
        phases=(
            Phase("dense", 4, ((256, 0.0), (512, 0.5)), 1e-3, warmup_steps=2),
            Phase("index", 2, _joined_at_once(640), 1e-3, warmup_steps=2),
            Phase("msa", 2, _joined_at_once(640), 5e-5, warmup_steps=1, dense_every=2),
        ),
        eval_contexts=(640,),
        eval_samples=2,
    ),
}


def learning_rate(phase: Phase, step: int) -> float:
    """Linear warm-up over min(phase.warmup_steps, steps / 10), then cosine decay to a tenth."""
    warmup = max(1, min(phase.warmup_steps, phase.steps // 10))
    if step < warmup:
        return phase.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, phase.steps - warmup)
    return phase.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    """One run: the model, its optimizer, the task, the preset's phases and the run's clock and budget."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.started = time.monotonic()
        self.device = torch.device(opts.device)
        self.preset = PRESETS[opts.preset]
        if opts.eval_samples is not None:
            self.preset = replace(self.preset, eval_samples=opts.eval_samples)
        tokenizer = load_tokenizer(opts.tokenizer)
        if tokenizer.get_vocab_size() != NEEDLE_CONFIG["vocab_size"] or tokenizer.token_to_id("<|eos|>") != EOS:
            raise SystemExit(
                f"{opts.tokenizer} is not the demo tokenizer (vocab {tokenizer.get_vocab_size()}, "
                f"<|eos|> id {tokenizer.token_to_id('<|eos|>')}; expected {NEEDLE_CONFIG['vocab_size']} and {EOS}): "
                "build it with `python serve/build_demo_model.py DIR`"
            )
        self.task = PassKeyTask(tokenizer, EOS, opts.filler, opts.distractors)
        torch.manual_seed(opts.seed)
        self.model = FlashMSAForCausalLM(NEEDLE_CONFIG, seed=opts.seed).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=WEIGHT_DECAY)
        self.state_path = opts.out / "state.pt"
        self.phases = list(self.preset.phases)
        self.phase_index, self.step = 0, 0
        self.evaluations: list[dict] = []  # one per finished phase
        self.best: dict | None = None  # the evaluated weights to export: {"after", "msa" (mean accuracy), "model"}
        self.phase_seconds = [0.0] * len(self.phases)  # training seconds of each phase so far
        self.eval_estimate_s = 0.0  # seconds of one evaluation: measured by --fit-time, then the last one's
        self.estimated_step_s: dict[tuple[str, str, int], float] = {}  # (phase, attention, context): s, --fit-time
        self.last_saved = time.monotonic()

    # ------------------------------------------------------------------------------------------ clock

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def time_left(self) -> float:
        budget = self.opts.time_budget_s
        return math.inf if budget is None else budget - self.elapsed() - RESERVE_S

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    # ------------------------------------------------------------------------------------------ steps

    def batch(self, phase_index: int, step: int, context: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """Tokens [count, context + 1] (inputs: the first `context`), their answer mask, and the distillation's
        focus span: the input positions of the question and the answer."""
        count = max(1, self.preset.tokens_per_step // context)
        seed = [self.opts.seed, phase_index, step]
        block_size = NEEDLE_CONFIG["msa_config"]["block_size"]
        trailing = int(np.random.default_rng([*seed, 1]).integers(min(block_size, context // 2)))
        tokens, answer_mask = self.task.training_sequences(seed, context + 1, count, trailing, self.opts.chat_share)
        first_answer = int(answer_mask.any(0).argmax())
        question = len(self.task.question) + (len(self.task.chat_assistant) if self.opts.chat_share else 0)
        focus = (first_answer - question, context + 1 - trailing)  # chat rows' question ends before the template
        tokens, answer_mask = torch.from_numpy(tokens), torch.from_numpy(answer_mask)
        if self.device.type == "cuda":
            tokens, answer_mask = tokens.pin_memory(), answer_mask.pin_memory()
        return tokens.to(self.device, non_blocking=True), answer_mask.to(self.device, non_blocking=True), focus

    def set_trainable(self, model: FlashMSAForCausalLM, phase: Phase) -> None:
        index = {id(p) for p in model.index_parameters()}
        for param in model.parameters():
            param.requires_grad_(phase.name != "index" or id(param) in index)

    def train_step(
        self, model, optimizer, phase: Phase, phase_index: int, step: int, context: int, attention: str
    ) -> dict[str, torch.Tensor]:
        """One optimizer step; the step's metrics as device tensors (no host sync). The dense steps of phase
        "msa" name theirs dense_*."""
        tokens, answer_mask, focus = self.batch(phase_index, step, context)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(phase, step)
        with self.autocast():
            if phase.name == "index":
                _, kl = model(tokens[:, :-1], attention="dense", distill=True, distill_focus=focus)
                loss, metrics = kl, {"kl": kl.detach()}
            else:
                distill = phase.name == "msa"
                logits, kl = model(tokens[:, :-1], attention=attention, distill=distill, distill_focus=focus)
                targets, mask = tokens[:, 1:], answer_mask[:, 1:]
                ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
                answer_ce, lm_ce = ce[mask].mean(), ce[~mask].mean()
                loss = answer_ce + LM_WEIGHT * lm_ce + (kl if kl is not None else 0.0)
                right = (logits.argmax(-1) == targets) | ~mask
                metrics = {"answer_ce": answer_ce.detach(), "lm_ce": lm_ce.detach(), "acc": right.all(1).float().mean()}
                if kl is not None:
                    metrics["kl"] = kl.detach()
                if phase.name == "msa" and attention == "dense":
                    metrics = {f"dense_{name}": value for name, value in metrics.items()}
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], GRAD_CLIP)
        optimizer.step()
        return metrics

    # ------------------------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def accuracy(self, model, context: int, attention: str) -> float:
        """Share of --eval-samples prompts of `context` tokens (keys at evenly spaced depths) answered exactly."""
        samples = self.preset.eval_samples
        rng = np.random.default_rng([self.opts.seed, 1_000_003, context])
        prompts = [self.task.prompt(context, i / max(1, samples - 1), random_key(rng), rng) for i in range(samples)]
        per_batch = max(1, self.preset.tokens_per_step // context)
        right = 0
        for start in range(0, samples, per_batch):
            chunk = prompts[start : start + per_batch]
            length = max(len(p.prompt_ids) + len(p.answer_ids) for p in chunk)
            tokens = torch.full((len(chunk), length), NEEDLE_CONFIG["pad_token_id"], dtype=torch.long)
            for row, p in enumerate(chunk):
                tokens[row, : len(p.prompt_ids) + len(p.answer_ids)] = torch.tensor(p.prompt_ids + p.answer_ids)
            with self.autocast():
                logits, _ = model(tokens.to(self.device), attention=attention)
            predicted = logits.argmax(-1).cpu()
            for row, p in enumerate(chunk):
                answer = slice(len(p.prompt_ids) - 1, len(p.prompt_ids) - 1 + len(p.answer_ids))
                right += bool((predicted[row, answer] == torch.tensor(p.answer_ids)).all())
        return right / samples

    def evaluate(self, label: str, log: bool = True) -> dict:
        started = time.monotonic()
        self.model.eval()
        result = {
            mode: {str(c): self.accuracy(self.model, c, mode) for c in self.preset.eval_contexts}
            for mode in ("dense", "msa")
        }
        self.model.train()
        seconds = time.monotonic() - started
        if log:
            for mode, by_context in result.items():
                cells = "  ".join(f"{c}: {a:.2f}" for c, a in by_context.items())
                print(f"[eval after {label}] {mode:<5} pass-key accuracy by context  {cells}", flush=True)
            print(f"[eval after {label}] {self.preset.eval_samples} prompts per context, {seconds:.0f} s", flush=True)
        return {"after": label, "samples": self.preset.eval_samples, "seconds": round(seconds, 1), **result}

    def keep_if_best(self, evaluation: dict) -> None:
        """Keep a copy of the weights when their mean MSA accuracy is the best so far (the later on a tie)."""
        msa = float(np.mean(list(evaluation["msa"].values())))
        if self.best is None or msa >= self.best["msa"]:
            weights = {name: t.detach().to("cpu", copy=True) for name, t in self.model.state_dict().items()}
            self.best = {"after": evaluation["after"], "msa": msa, "model": weights}

    # ------------------------------------------------------------------------------------------ state

    def save(self) -> None:
        self.sync()
        state = {
            "preset": self.opts.preset,
            "seed": self.opts.seed,
            "data": run_data(self.opts),
            "phase_index": self.phase_index,
            "step": self.step,
            "steps": [p.steps for p in self.phases],
            "evaluations": self.evaluations,
            "best": self.best,
            "phase_seconds": self.phase_seconds,
            "estimated_step_s": self.estimated_step_s,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.state_path)
        self.last_saved = time.monotonic()

    def resume(self) -> bool:
        if not self.state_path.is_file():
            return False
        state = torch.load(self.state_path, map_location=self.device, weights_only=False)
        saved = state["preset"], state["seed"], state.get("data", SHIPPED_DATA)  # older runs: the shipped data
        wanted = self.opts.preset, self.opts.seed, run_data(self.opts)
        if saved != wanted:
            raise SystemExit(
                f"{self.state_path} is a run of preset {saved[0]} seed {saved[1]} data {saved[2]}, not preset "
                f"{wanted[0]} seed {wanted[1]} data {wanted[2]}: use another --out"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.phases = [replace(p, steps=n) for p, n in zip(self.phases, state["steps"])]
        self.phase_index, self.step = state["phase_index"], state["step"]
        self.evaluations, self.phase_seconds = state["evaluations"], state["phase_seconds"]
        self.best = state.get("best")
        self.estimated_step_s = state["estimated_step_s"]
        name = self.phases[self.phase_index].name if self.phase_index < len(self.phases) else "done"
        print(f"resuming: phase {self.phase_index + 1} ({name}), step {self.step}", flush=True)
        return True

    # ------------------------------------------------------------------------------------ time fitting

    def measure(self, timed_steps: int = 3) -> tuple[dict[tuple[str, str, int], float], float, float]:
        """Seconds per training step of every (phase, attention, context), measured on a copy of the model
        (the run's weights and optimizer stay untouched), and of one evaluation (dense + MSA) of the untrained
        model twice: the first includes the warm-up of every shape (the first H200 run: 12.8 s, later
        ones 3-4 s), the second is what each phase's evaluation costs."""
        step_s = {}
        for phase_index, phase in enumerate(self.phases):
            model = copy.deepcopy(self.model)
            self.set_trainable(model, phase)
            optimizer = torch.optim.AdamW(model.parameters(), lr=phase.lr, weight_decay=WEIGHT_DECAY)
            for attention in phase.attentions():
                for context in sorted({c for c, _ in phase.curriculum}):
                    for warm in range(2 + timed_steps):
                        if warm == 2:
                            self.sync()
                            started = time.monotonic()
                        self.train_step(model, optimizer, phase, phase_index, warm, context, attention)
                    self.sync()
                    step_s[(phase.name, attention, context)] = (time.monotonic() - started) / timed_steps
            del model, optimizer
        started = time.monotonic()
        self.evaluate("timing (the untrained model)")
        first_eval_s = time.monotonic() - started
        started = time.monotonic()
        self.evaluate("timing, again", log=False)
        return step_s, first_eval_s, time.monotonic() - started

    def phase_estimate(self, phase: Phase, first_step: int = 0) -> float:
        return sum(
            self.estimated_step_s[(phase.name, phase.attention(s), phase.context(s))]
            for s in range(first_step, phase.steps)
        )

    def fit_time(self) -> None:
        """Scale every phase's steps by one factor so the estimated run fits the time budget."""
        step_s, first_eval_s, eval_s = self.measure()
        self.eval_estimate_s = eval_s
        self.estimated_step_s = {k: v * FIT_SAFETY for k, v in step_s.items()}
        by_kind = ", ".join(
            f"{name}{'/dense' if name == 'msa' and attention == 'dense' else ''} {context}: {s * 1e3:.0f} ms"
            for (name, attention, context), s in step_s.items()
        )
        print(
            f"[timing] step time: {by_kind}; one evaluation {eval_s:.1f} s (the first, warming up: "
            f"{first_eval_s:.1f} s)",
            flush=True,
        )
        estimated = [self.phase_estimate(p) for p in self.phases]
        evaluations = len(self.phases) * eval_s * FIT_SAFETY
        available = self.time_left() - evaluations
        if available <= 0:
            raise SystemExit(f"--time-budget-s {self.opts.time_budget_s} leaves no time to train after the timing")
        factor = available / sum(estimated)
        self.phases = [replace(p, steps=max(1, round(p.steps * factor))) for p in self.phases]
        print(
            f"[timing] estimated phases {' + '.join(f'{e:.0f}' for e in estimated)} s, evaluations {evaluations:.0f} s "
            f"(x{FIT_SAFETY}); {self.time_left():.0f} s left: steps x {factor:.2f} -> {[p.steps for p in self.phases]}",
            flush=True,
        )

    def refit(self) -> None:
        """At a later phase's start: shrink the remaining phases if the finished ones ran slower than estimated."""
        done = self.phases[: self.phase_index]
        slower = sum(self.phase_seconds[: self.phase_index]) / max(1e-9, sum(self.phase_estimate(p) for p in done))
        remaining = self.phases[self.phase_index :]
        needed = max(1.0, slower) * sum(self.phase_estimate(p) for p in remaining)
        available = self.time_left() - len(remaining) * self.eval_estimate_s * FIT_SAFETY
        if needed <= available:
            return
        factor = max(0.0, available) / needed
        self.phases[self.phase_index :] = [replace(p, steps=max(1, int(p.steps * factor))) for p in remaining]
        print(
            f"[timing] finished phases ran x{slower:.2f} the estimate: remaining steps x {factor:.2f} -> "
            f"{[p.steps for p in self.phases[self.phase_index :]]}",
            flush=True,
        )

    # -------------------------------------------------------------------------------------------- run

    def run_phase(self) -> bool:
        """Train the current phase from self.step; False when the budget stopped it. With --fit-time the last
        phase ends early instead, when no more than its evaluation and the export fit in the budget."""
        phase, index = self.phases[self.phase_index], self.phase_index
        label = f"phase {index + 1} {phase.name}"
        print(f"== {label}: steps {self.step}..{phase.steps}", flush=True)
        self.set_trainable(self.model, phase)
        pending, tokens, last_log, started, first_step = [], 0, time.monotonic(), time.monotonic(), self.step
        longest_step_s = max((s for (name, _, _), s in self.estimated_step_s.items() if name == phase.name), default=0)
        end_early = self.opts.fit_time and index == len(self.phases) - 1
        keep_s = self.eval_estimate_s * FIT_SAFETY if end_early else 0.0  # the last phase's evaluation
        while self.step < phase.steps:
            mean_step_s = (time.monotonic() - started) / max(1, self.step - first_step)
            if self.time_left() - keep_s < max(longest_step_s, mean_step_s):
                if not end_early:
                    self._add_phase_time(index, started)
                    return False
                print(
                    f"[timing] {label} ends early at step {self.step} of {phase.steps}: what is left of the budget "
                    "is its evaluation's and the export's",
                    flush=True,
                )
                self.phases[index] = phase = replace(phase, steps=self.step)
                break
            context, attention = phase.context(self.step), phase.attention(self.step)
            pending.append(self.train_step(self.model, self.optimizer, phase, index, self.step, context, attention))
            tokens += max(1, self.preset.tokens_per_step // context) * context
            self.step += 1
            now = time.monotonic()
            if now - last_log >= LOG_EVERY_S or self.step == phase.steps:
                names = dict.fromkeys(k for metrics in pending for k in metrics)
                names = sorted(names, key=lambda k: k.startswith("dense_"))  # phase 3's MSA steps' first
                means = {k: torch.stack([m[k] for m in pending if k in m]).mean().item() for k in names}
                rate = tokens / (time.monotonic() - last_log)
                losses = "  ".join(f"{k} {v:.3f}" for k, v in means.items())
                contexts = ",".join(map(str, phase.contexts(self.step - 1)))
                print(
                    f"[{label}] step {self.step}/{phase.steps}  ctx {contexts}  {losses}  "
                    f"{rate / 1e3:.1f}K tok/s  {self.elapsed():.0f} s",
                    flush=True,
                )
                pending, tokens, last_log = [], 0, time.monotonic()
            if now - self.last_saved >= SAVE_EVERY_S:
                self.save()
        self._add_phase_time(index, started)
        return True

    def _add_phase_time(self, index: int, started: float) -> None:
        self.sync()
        self.phase_seconds[index] += time.monotonic() - started

    def run(self) -> int:
        self.opts.out.mkdir(parents=True, exist_ok=True)
        params = sum(p.numel() for p in self.model.parameters())
        print(f"model: {params / 1e6:.2f}M parameters, {len(self.model.model.layers)} layers, device {self.device}")
        if not self.resume() and self.opts.fit_time:
            if self.opts.time_budget_s is None:
                raise SystemExit("--fit-time needs --time-budget-s")
            self.fit_time()
        while self.phase_index < len(self.phases):
            if self.step == 0 and self.opts.fit_time and self.phase_index > 0 and self.estimated_step_s:
                self.refit()
            if self.step < self.phases[self.phase_index].steps and not self.run_phase():
                return self.stop()
            if len(self.evaluations) == self.phase_index:
                if self.time_left() < self.eval_estimate_s * FIT_SAFETY:
                    return self.stop()
                self.evaluations.append(self.evaluate(f"phase {self.phase_index + 1}"))
                self.eval_estimate_s = self.evaluations[-1]["seconds"]
                self.keep_if_best(self.evaluations[-1])
            self.phase_index, self.step = self.phase_index + 1, 0
            self.save()
        exported = self.export_best()
        model_dir = export_checkpoint(self.model, self.opts.tokenizer, self.opts.out / "model")
        summary = {
            "preset": self.opts.preset,
            "seed": self.opts.seed,
            "device": str(self.device),
            "steps": {p.name: p.steps for p in self.phases},
            "tokens_per_step": self.preset.tokens_per_step,
            "phase_seconds": [round(s, 1) for s in self.phase_seconds],
            "train_seconds": round(sum(self.phase_seconds), 1),
            "evaluations": self.evaluations,
            "exported": exported,
        }
        (self.opts.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(
            f"done in {self.elapsed():.0f} s (training {sum(self.phase_seconds):.0f} s in all): checkpoint {model_dir}"
        )
        return 0

    def export_best(self) -> dict:
        """Load the best evaluated weights into the model when they are not the last phase's; what is exported."""
        last = self.evaluations[-1]["after"]
        if self.best is None or self.best["after"] == last:
            return {"after": last, "why": "the best mean MSA accuracy of the evaluated phases"}
        means = {
            e["after"]: round(float(np.mean(list(e["msa"].values()))), 3)
            for e in self.evaluations
            if e["after"] in (last, self.best["after"])
        }
        best = self.best["after"]
        why = (
            f"{last} lowered the mean MSA accuracy over the evaluation contexts to {means[last]:.3f} from "
            f"{means[best]:.3f} after {best}: exporting the weights after {best}"
        )
        print(f"[export] {why}", flush=True)
        self.model.load_state_dict(self.best["model"])
        return {"after": self.best["after"], "why": why}

    def stop(self) -> int:
        self.save()
        name = self.phases[self.phase_index].name
        print(
            f"time budget: stopped at phase {self.phase_index + 1} ({name}) step {self.step} after "
            f"{self.elapsed():.0f} s; run the same command again to continue",
            flush=True,
        )
        return BUDGET_STOPPED


SHIPPED_DATA = {"chat_share": 0.0, "filler": "fixed", "distractors": 0}  # what models/needle-msa was trained on


def run_data(opts: argparse.Namespace) -> dict:
    """What a run's sequences are made of besides its seed: a resumed run must keep it."""
    return {"chat_share": opts.chat_share, "filler": opts.filler, "distractors": opts.distractors}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a checkpoint directory with the demo tokenizer")
    parser.add_argument("--out", type=Path, required=True, help="run directory: state.pt, model/, summary.json")
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--time-budget-s", type=float, help="stop (exit 3, resumable) before this many seconds")
    parser.add_argument("--fit-time", action="store_true", help="scale the phases' steps to fit --time-budget-s")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eval-samples", type=int, help="prompts per context in each evaluation (preset's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat-share", type=float, default=0.0, help="share of training sequences in the chat format (default 0)"
    )
    parser.add_argument("--filler", choices=FILLERS, default="fixed", help="the prompts' filler sentences")
    parser.add_argument("--distractors", type=int, default=0, help="sentences with other numbers in every prompt")
    opts = parser.parse_args(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if opts.eval_samples is not None and opts.eval_samples < 1:
        parser.error("--eval-samples must be >= 1")
    if not 0.0 <= opts.chat_share <= 1.0:
        parser.error(f"--chat-share must be within [0, 1], not {opts.chat_share}")
    if opts.distractors < 0:
        parser.error(f"--distractors must be >= 0, not {opts.distractors}")
    if opts.time_budget_s is not None and opts.time_budget_s <= RESERVE_S:
        parser.error(f"--time-budget-s must exceed {RESERVE_S:.0f} s")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.device == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    return Trainer(opts).run()


if __name__ == "__main__":
    sys.exit(main())
