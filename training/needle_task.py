"""Pass-key retrieval (needle in a haystack) prompts as token ids of a checkpoint's tokenizer.

Owns the task that issue 19's model is trained and evaluated on. A prompt of exactly N tokens reads

    INSTRUCTION  filler ... KEY_SENTENCE ... filler  QUESTION

where the filler is sentences drawn at random from FILLER_SENTENCES (or, with filler="grammar", from GRAMMAR's
thousands of sentences), the key sentence (a 5-digit pass key)
sits at a sentence boundary at the chosen depth of the filler (0: right after the instruction, 1: right
before the question), and the answer is ANSWER (" NNNNN.") followed by the end-of-text token: the full
stop and EOS end the number, so greedy decoding stops after the key's last digit. With distractors=N, N
sentences holding other 5-digit numbers (DISTRACTOR_SENTENCES) sit at random sentence boundaries of the filler,
so the key is told by its sentence, not by being the prompt's only number. Every piece is
tokenized on its own (the key's digits too: " NNNNN" is the same tokens in the key sentence and the answer)
and the ids concatenated, so lengths are exact; servers get the ids as the prompt.

In the chat format (issue 49) the same prompt is the one user message of the demo's ChatML template
(vllm_msa.checkpoint.CHAT_TEMPLATE), as /v1/chat/completions renders it with the generation prompt:

    CHAT_USER  INSTRUCTION ... QUESTION  CHAT_ASSISTANT  ANSWER

Training (training/train_needle.py), the in-training evaluation and the served evaluation
(serve/eval_needle.py) all build their prompts here; everything is deterministic by seed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INSTRUCTION = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n"
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}."
CHAT_USER = "<|im_start|>user\n"  # the template's text around one user message, then the generation prompt
CHAT_ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
KEY_DIGITS = 5
FILLER_STREAM_TOKENS = 1 << 21  # prompts of up to half of it (1M tokens)
FILLER_SENTENCES = (
    " The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
    " The river runs slowly past the old mill.",
    " A small boat drifts along the shore.",
    " Clouds gather over the distant hills.",
    " The market opens early on Saturday.",
    " Birds sing in the tall trees by the road.",
    " The train leaves the station at noon.",
    " Children play in the park after school.",
    " The library is quiet in the afternoon.",
    " A cold wind blows from the north.",
    " The baker sells fresh bread every morning.",
    " Snow covers the mountain tops in winter.",
    " The lamp on the desk gives a warm light.",
    " An old clock ticks in the hallway.",
    " The garden is full of red and white flowers.",
    " Ships wait in the harbour for the tide.",
)

# Issue 49's larger filler pool: " The {adjective} {noun} {verb} {place}." over these words (20 x 20 x 20 x 20 =
# 160,000 sentences), of which a seeded draw of GRAMMAR_POOL distinct ones fill the stream.
# fmt: off
GRAMMAR = (  # adjectives, nouns, verbs, places
    ("old", "small", "quiet", "red", "tall", "green", "busy", "cold", "bright", "narrow", "empty", "wooden",
     "distant", "gentle", "heavy", "young", "round", "dark", "warm", "simple"),
    ("house", "river", "garden", "bridge", "market", "window", "road", "forest", "station", "tower", "boat",
     "village", "field", "lamp", "school", "harbour", "kitchen", "mountain", "library", "wagon"),
    ("stands", "waits", "rests", "shines", "sleeps", "turns", "grows", "fades", "leans", "sits", "stays", "hides",
     "glows", "moves", "lies", "rises", "dries", "opens", "closes", "sways"),
    ("by the sea", "in the morning", "near the hill", "under the trees", "after the rain", "in the valley",
     "at dusk", "beside the lake", "in the snow", "on the corner", "past the fields", "at noon", "in the fog",
     "behind the wall", "across the square", "in the summer", "by the old gate", "at the crossroads",
     "under the stars", "along the shore"),
)
# fmt: on
GRAMMAR_POOL = 4096
FILLERS = ("fixed", "grammar")
DISTRACTOR_SENTENCES = (" The room number is {n}.", " The train leaves from platform {n}.", " Call {n} for help.")


def grammar_sentences(count: int, seed: int = 0) -> list[str]:
    """`count` distinct sentences of GRAMMAR, drawn with this seed."""
    sizes = [len(words) for words in GRAMMAR]
    total = int(np.prod(sizes))
    if count > total:
        raise ValueError(f"GRAMMAR has {total} sentences, not {count}")
    sentences = []
    for index in np.random.default_rng(seed).choice(total, size=count, replace=False):
        words = []
        for choices, size in zip(GRAMMAR, sizes):
            index, pick = divmod(int(index), size)
            words.append(choices[pick])
        adjective, noun, verb, place = words
        sentences.append(f" The {adjective} {noun} {verb} {place}.")
    return sentences


@dataclass(frozen=True)
class PassKeyPrompt:
    prompt_ids: list[int]  # exactly the requested number of tokens
    answer_ids: list[int]  # ANSWER's tokens, then EOS
    key: str
    key_position: int  # index of the key sentence's first token in prompt_ids


def load_tokenizer(tokenizer_dir: str | Path):
    """The `tokenizers` Tokenizer of tokenizer_dir/tokenizer.json (the demo checkpoint's byte-level BPE)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise SystemExit(
            f"the pass-key task needs the 'tokenizers' package ({e}); install it or carry its wheel"
        ) from e
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a checkpoint directory with a tokenizer.json")
    return Tokenizer.from_file(str(path))


def answer_is_correct(completion: str, key: str) -> bool:
    """The completion starts (after spaces) with exactly the key's digits: a sixth digit is wrong."""
    match = re.match(r"\s*(\d+)", completion)
    return match is not None and match.group(1) == key


def random_key(rng: np.random.Generator) -> str:
    return str(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS))


class PassKeyTask:
    """Pass-key prompts of exact token lengths for one tokenizer; eos_id ends every answer.

    The filler comes from one stream of FILLER_STREAM_TOKENS tokens of sentences drawn from FILLER_SENTENCES, or
    with filler="grammar" from GRAMMAR_POOL sentences of GRAMMAR (seed 0): a prompt takes a window of it that starts
    at a random sentence, so building a prompt costs a slice, not a draw per sentence. distractors: sentences with
    other numbers in every prompt (DISTRACTOR_SENTENCES). The defaults are the shipped model's task.
    """

    def __init__(self, tokenizer, eos_id: int, filler: str = "fixed", distractors: int = 0) -> None:
        if filler not in FILLERS:
            raise ValueError(f"filler {filler!r} is not one of {FILLERS}")
        if distractors < 0:
            raise ValueError(f"distractors {distractors} is negative")
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.distractors = distractors
        self._key_tokens: dict[str, list[int]] = {}
        self.instruction = self._ids(INSTRUCTION)
        self.question = self._ids(QUESTION)
        self.chat_user, self.chat_assistant = self._ids(CHAT_USER), self._ids(CHAT_ASSISTANT)
        # The key's own tokens (" NNNNN", with its space) go between these.
        before, between, after = (part.rstrip(" ") for part in KEY_SENTENCE.split("{key}"))
        self.key_sentence_parts = self._ids(before), self._ids(between), self._ids(after)
        self.full_stop = self._ids(ANSWER.split("{key}")[1])
        # Each distractor sentence's tokens around its number (" NNNNN", as a key's).
        self.distractor_parts = [tuple(self._ids(part) for part in s.split(" {n}")) for s in DISTRACTOR_SENTENCES]
        pool = FILLER_SENTENCES if filler == "fixed" else grammar_sentences(GRAMMAR_POOL)
        sentences = [np.array(self._ids(s), dtype=np.int64) for s in pool]
        mean_tokens = sum(len(s) for s in sentences) / len(sentences)
        drawn = np.random.default_rng(0).integers(len(sentences), size=int(FILLER_STREAM_TOKENS / mean_tokens) + 1)
        self.filler_stream = np.concatenate([sentences[i] for i in drawn])
        self.sentence_starts = np.cumsum([0] + [len(sentences[i]) for i in drawn[:-1]])

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _key_ids(self, key: str) -> list[int]:
        if key not in self._key_tokens:
            self._key_tokens[key] = self._ids(" " + key)
        return self._key_tokens[key]

    def answer_ids(self, key: str) -> list[int]:
        """ANSWER's tokens (" NNNNN.") and EOS."""
        return [*self._key_ids(key), *self.full_stop, self.eos_id]

    def _key_sentence(self, key: str) -> list[int]:
        before, between, after = self.key_sentence_parts
        key_ids = self._key_ids(key)
        return [*before, *key_ids, *between, *key_ids, *after]

    def min_prompt_tokens(self) -> int:
        """The shortest prompt: instruction, key sentence and question without filler."""
        return len(self.instruction) + len(self._key_sentence("9" * KEY_DIGITS)) + len(self.question)

    def prompt(self, num_tokens: int, depth: float, key: str, rng: np.random.Generator) -> PassKeyPrompt:
        """A prompt of exactly num_tokens tokens with the key sentence at `depth` (0..1) of the filler, at the
        sentence boundary nearest to it; the filler window is drawn from rng."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth {depth} is not within [0, 1]")
        if len(key) != KEY_DIGITS or not key.isdigit():
            raise ValueError(f"pass key {key!r} is not {KEY_DIGITS} digits")
        key_ids = self._key_sentence(key)
        distractors = [self._distractor(key, rng) for _ in range(self.distractors)]
        inserted = len(key_ids) + sum(len(d) for d in distractors)
        filler_tokens = num_tokens - len(self.instruction) - inserted - len(self.question)
        if filler_tokens < 0:
            raise ValueError(f"a pass-key prompt needs at least {num_tokens - filler_tokens} tokens, not {num_tokens}")
        if filler_tokens > len(self.filler_stream) // 2:
            raise ValueError(f"prompts of {num_tokens} tokens exceed the filler stream ({FILLER_STREAM_TOKENS} tokens)")
        starts = self.sentence_starts
        first = int(rng.integers(np.searchsorted(starts, len(self.filler_stream) // 2)))
        window_start = int(starts[first])
        filler = self.filler_stream[window_start : window_start + filler_tokens]
        boundaries = starts[first : np.searchsorted(starts, window_start + filler_tokens, side="right")] - window_start
        boundaries = np.append(boundaries, filler_tokens)
        split = int(boundaries[np.abs(boundaries - depth * filler_tokens).argmin()])
        # The key sentence, then the distractors, each at its sentence boundary (the key first where they share one).
        insertions = [(split, 0, key_ids)]
        insertions += [(int(rng.choice(boundaries)), 1 + i, ids) for i, ids in enumerate(distractors)]
        prompt_ids, done, key_position = [*self.instruction], 0, 0
        for at, _, ids in sorted(insertions, key=lambda insertion: insertion[:2]):
            prompt_ids += filler[done:at].tolist()
            done = at
            key_position = len(prompt_ids) if ids is key_ids else key_position
            prompt_ids += ids
        prompt_ids += [*filler[done:].tolist(), *self.question]
        return PassKeyPrompt(prompt_ids, self.answer_ids(key), key, key_position)

    def _distractor(self, key: str, rng: np.random.Generator) -> list[int]:
        """A DISTRACTOR_SENTENCES sentence holding a 5-digit number other than the key."""
        number = key
        while number == key:
            number = random_key(rng)
        before, after = self.distractor_parts[int(rng.integers(len(self.distractor_parts)))]
        return [*before, *self._key_ids(number), *after]

    def chat(self, sample: PassKeyPrompt) -> PassKeyPrompt:
        """The prompt as the one user message of the chat template, with the generation prompt after it: the ids
        /v1/chat/completions gives the model for the prompt's text."""
        prompt_ids = [*self.chat_user, *sample.prompt_ids, *self.chat_assistant]
        return PassKeyPrompt(prompt_ids, sample.answer_ids, sample.key, sample.key_position + len(self.chat_user))

    def training_sequences(
        self, seed: int | list[int], context: int, count: int, trailing: int = 0, chat_share: float = 0.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """`count` sequences of exactly `context` tokens, prompt + answer + `trailing` tokens, and a mask of the
        answer tokens (both [count, context]). The trailing tokens are the start of a next document (the
        instruction, then filler), as in packed training data: they move the answer off the sequence's end,
        so that it does not always sit at the same place in its 128-token block (the evaluation's and the
        server's answers start wherever the prompt ends). A share `chat_share` of the rows (drawn per row) are in
        the chat format (chat): the answer ends at the same place, the question sits len(chat_assistant) tokens
        earlier."""
        if not 0.0 <= chat_share <= 1.0:
            raise ValueError(f"chat_share {chat_share} is not within [0, 1]")
        rng = np.random.default_rng(seed)
        chat_rng = np.random.default_rng([*np.atleast_1d(seed).tolist(), 2])  # the plain rows draw as before
        tokens = np.empty((count, context), dtype=np.int64)
        answer_mask = np.zeros((count, context), dtype=bool)
        end = context - trailing
        wrapped = len(self.chat_user) + len(self.chat_assistant)
        for row in range(count):
            key = random_key(rng)
            answer = self.answer_ids(key)
            as_chat = chat_share > 0.0 and chat_rng.random() < chat_share
            length = end - len(answer) - (wrapped if as_chat else 0)
            sample = self.prompt(length, float(rng.random()), key, rng)
            tokens[row, :end] = (self.chat(sample) if as_chat else sample).prompt_ids + answer
            answer_mask[row, end - len(answer) : end] = True
            if trailing:
                start = int(self.sentence_starts[rng.integers(len(self.sentence_starts) // 2)])
                next_document = [*self.instruction, *self.filler_stream[start : start + trailing].tolist()]
                tokens[row, end:] = next_document[:trailing]
        return tokens, answer_mask
