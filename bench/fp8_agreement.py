"""FP8 against bf16 caches: how often the blocks selected over FP8 index keys agree with bf16's, what FP8 index keys
and an FP8 K/V cache do to the attention output, and to greedy tokens. Runs on CPU (the reference defines what the
kernels compute), from the repository root:

    PYTHONPATH=. python -m bench.fp8_agreement [--contexts 4096 16384 65536 131072]
        [--tokens 32] [--demo-contexts 2048 8192 32768] [--m3-contexts 2048 8192]
        [--greedy-lengths 1024 2048 4096] [--greedy-tokens 16] [--greedy-presets default m3-attention]
        [--models-dir DIR]

Index keys: one MSA layer's decode queries at the last --tokens positions of one context (one request each),
selected over a bf16 index-key cache (bf16 index queries) and over the FP8 cache of the same bf16 keys
(indexer_kv_dtype fp8: e4m3 keys and e4m3-rounded index queries, msa_kernels.fp8_index_keys). Per context
length it prints, over the (token, index head) pairs: the fraction whose FP8 block set is identical to the
bf16 one; the same with FP8 keys but bf16 queries (what rounding the queries adds); for scale, the fraction
whose bf16 set is identical to the set from the float32 keys and queries the bf16 ones were rounded from;
the fraction of the bf16 set's blocks the FP8 set also holds; then the cosine (mean and minimum over
tokens, all heads of a token as one vector) between the attention outputs over the FP8 selection and over
the bf16 selection (same bf16 q, K and V).
K/V: the cosine between the attention outputs over the bf16 selection from an FP8 K/V cache (--kv-cache-dtype
fp8: e4m3 of K and V, scale 1.0 as vLLM uses without checkpoint scales, msa_kernels.reference.write_paged) and
from the bf16 one.

- random: normal index queries and keys (float32), q, K and V (bf16) at MiniMax-M3's layer shape (Hq 64,
  Hkv 4, D 128, Hi 4, Dp 128, top-16 of 128-token blocks). Random keys make blocks' max-pooled scores nearly
  tie: the pessimistic case.
- demo / m3-attention: real activations of the demo checkpoint and of its m3-attention preset
  (serve/build_demo_model.py, built into --models-dir): tests/reference_model.py runs the model (float32) on
  the tokens of stdlib Python source, and the inputs of every MSA layer are captured where it calls
  msa_attention (q, K and V then rounded to bf16, as a bf16 model's caches); the layers' pairs are pooled.
- greedy: greedy tokens of the demo checkpoint's reference model (each of --greedy-presets: the default
  preset, the m3-attention one) with FP8, bf16 and float32 index keys
  (msa_config.indexer_kv_dtype fp8, bf16, auto), the rest of the model in float32, on source-text prompts of
  each length: where FP8 first differs from bf16, and bf16 from float32; and with bf16 index keys and an FP8
  K/V cache in every layer: where it first differs from the float32 K/V.
"""

import argparse
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

from bench.problems import M3_SHAPE, SCALE
from msa_kernels import ops
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache, dequantize_rows
from msa_kernels.plan import StepPlan
from msa_kernels.reference import fp8_kv_cache
from msa_kernels.shapes import MSAShape, PagedBatch


@dataclass
class LayerInputs:
    """One MSA layer's decode queries at positions context - n .. context - 1 of one context."""

    shape: MSAShape
    scale: float
    context: int
    q: torch.Tensor  # [n, Hq, D] bf16
    index_q: torch.Tensor  # [n, Hi, Dp] float32
    kv_cache: torch.Tensor  # [pages, 2, B, Hkv, D] bf16, the context's pages in order
    index_key_cache: torch.Tensor  # [pages, B, Hki, Dp] float32

    def batch(self) -> PagedBatch:
        """One request per query token, each seeing the context up to its position."""
        n, pages = self.q.shape[0], self.kv_cache.shape[0]
        return PagedBatch(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=torch.arange(self.context - n + 1, self.context + 1, dtype=torch.int32),
            block_table=torch.arange(pages, dtype=torch.int32).expand(n, pages),
        )


@dataclass
class Agreement:
    """FP8 against bf16 selections and outputs, pooled over the layers added."""

    sets: int = 0
    identical: int = 0
    identical_keys_only: int = 0
    identical_bf16_to_float32: int = 0
    blocks: int = 0
    shared_blocks: int = 0
    cosines: list[torch.Tensor] = field(default_factory=list)
    kv_cosines: list[torch.Tensor] = field(default_factory=list)  # FP8 K/V against bf16 K/V, bf16 selection

    def add(self, inputs: LayerInputs) -> None:
        s, plan = inputs.shape, StepPlan.of(inputs.batch())
        index_q, index_key_cache = inputs.index_q.bfloat16(), inputs.index_key_cache.bfloat16()
        fp8_cache = Fp8IndexKeyCache.quantize(index_key_cache)
        bf16 = ops.select_blocks(index_q, index_key_cache, plan, s)
        fp8 = ops.select_blocks(index_q, fp8_cache, plan, s)
        keys_only = ops.select_blocks(index_q, dequantize_rows(fp8_cache.values, fp8_cache.scales), plan, s)
        float32 = ops.select_blocks(inputs.index_q, inputs.index_key_cache, plan, s)
        self.sets += bf16.shape[0] * bf16.shape[1]
        self.identical += (fp8 == bf16).all(-1).sum().item()
        self.identical_keys_only += (keys_only == bf16).all(-1).sum().item()
        self.identical_bf16_to_float32 += (bf16 == float32).all(-1).sum().item()
        chosen = bf16 >= 0
        self.blocks += chosen.sum().item()
        self.shared_blocks += ((bf16[..., :, None] == fp8[..., None, :]).any(-1) & chosen).sum().item()
        bf16_out = ops.sparse_attention(inputs.q, inputs.kv_cache, plan, bf16, s, inputs.scale).float()
        fp8_out = ops.sparse_attention(inputs.q, inputs.kv_cache, plan, fp8, s, inputs.scale).float()
        fp8_kv_out = ops.sparse_attention(inputs.q, fp8_kv_cache(inputs.kv_cache), plan, bf16, s, inputs.scale).float()
        self.cosines.append(cosines(fp8_out, bf16_out))
        self.kv_cosines.append(cosines(fp8_kv_out, bf16_out))

    def row(self, context: int, seconds: float) -> str:
        index_cosines, kv_cosines = torch.cat(self.cosines), torch.cat(self.kv_cosines)
        cells = [
            str(context),
            str(self.sets),
            f"{self.identical / self.sets:.3f}",
            f"{self.identical_keys_only / self.sets:.3f}",
            f"{self.identical_bf16_to_float32 / self.sets:.3f}",
            f"{self.shared_blocks / self.blocks:.4f}",
            f"{index_cosines.mean().item():.5f}",
            f"{index_cosines.min().item():.5f}",
            f"{kv_cosines.mean().item():.5f}",
            f"{kv_cosines.min().item():.5f}",
            f"{seconds:.0f}",
        ]
        return "| " + " | ".join(cells) + " |"


HEADER = (
    "| context | (token, index head) sets | FP8 = bf16 | FP8 keys only = bf16 | bf16 = float32 | blocks shared "
    "| output cosine mean | output cosine min | FP8 K/V output cosine mean | FP8 K/V output cosine min | s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token, all heads as one vector."""
    return torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1), dim=1)


def random_inputs(shape: MSAShape, context: int, tokens: int, seed: int) -> LayerInputs:
    g = torch.Generator().manual_seed(seed)
    pages = -(-context // shape.block_size)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g)

    return LayerInputs(
        shape=shape,
        scale=SCALE,
        context=context,
        q=randn(tokens, shape.num_q_heads, shape.head_dim).bfloat16(),
        index_q=randn(tokens, shape.num_index_heads, shape.index_head_dim),
        kv_cache=randn(pages, 2, shape.block_size, shape.num_kv_heads, shape.head_dim).bfloat16(),
        index_key_cache=randn(pages, shape.block_size, shape.num_index_key_heads, shape.index_head_dim),
    )


def source_tokens(model_dir: Path, count: int) -> list[int]:
    """The first count tokens of the stdlib's Python source (what the demo tokenizer was trained on)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids += tokenizer.encode(path.read_text(errors="replace")).ids
        if len(ids) >= count:
            return ids[:count]
    raise ValueError(f"the stdlib's source holds fewer than {count} tokens")


def captured_inputs(model_dir: Path, context: int, tokens: int) -> list[LayerInputs]:
    """The inputs of every MSA layer of a reference forward over `context` source tokens, for the last tokens."""
    from tests import reference_model  # the repository's oracle: run from the repository root

    model = reference_model.ReferenceFlashMSA(model_dir)
    msa_attention, calls = reference_model.msa_attention, []

    def capture(q, index_q, kv_cache, index_key_cache, plan, shape, scale):
        calls.append((q, index_q, kv_cache, index_key_cache, shape, scale))
        return msa_attention(q, index_q, kv_cache, index_key_cache, plan, shape, scale)

    with mock.patch.object(reference_model, "msa_attention", capture):  # the name the model's layers call
        model.logits(source_tokens(model_dir, context))
    return [
        LayerInputs(
            shape=shape,
            scale=scale,
            context=context,
            q=q[-tokens:].bfloat16(),
            index_q=index_q[-tokens:],
            kv_cache=kv_cache.bfloat16(),
            index_key_cache=index_key_cache,
        )
        for layer, (q, index_q, kv_cache, index_key_cache, shape, scale) in enumerate(calls)
        if model.msa.is_sparse(layer)
    ]


def print_greedy_agreement(model_dir: Path, lengths: list[int], tokens: int) -> None:
    from tests.reference_model import ReferenceFlashMSA

    models = {dtype: ReferenceFlashMSA(model_dir, msa_overrides={"indexer_kv_dtype": dtype}) for dtype in KEY_FORMATS}
    fp8_kv = ReferenceFlashMSA(model_dir, msa_overrides={"indexer_kv_dtype": "bf16"}, kv_cache_dtype="fp8")
    print(
        "| prompt tokens | greedy tokens | FP8 = bf16: first difference at | bf16 = float32: first difference at "
        "| FP8 K/V = float32 K/V (bf16 index keys): first difference at | s |\n|---|---|---|---|---|---|"
    )
    for length in lengths:
        start, prompt = time.perf_counter(), source_tokens(model_dir, length)
        fp8, bf16, float32 = (models[dtype].greedy(prompt, tokens) for dtype in KEY_FORMATS)
        kv = fp8_kv.greedy(prompt, tokens)
        differences = " | ".join(first_difference(a, b) for a, b in ((fp8, bf16), (bf16, float32), (kv, bf16)))
        print(f"| {length} | {tokens} | {differences} | {time.perf_counter() - start:.0f} |")


KEY_FORMATS = ("fp8", "bf16", "auto")  # auto: the reference model's float32


def first_difference(tokens: list[int], other: list[int]) -> str:
    return next((str(i) for i, (a, b) in enumerate(zip(tokens, other)) if a != b), "none")


def build_models(models_dir: Path) -> dict[str, Path]:
    from serve.build_demo_model import PRESETS, build_demo_model

    return {
        name: build_demo_model(models_dir / f"demo-{name}", **PRESETS[name]) for name in ("default", "m3-attention")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--tokens", type=int, default=32, help="decode queries per context and layer")
    parser.add_argument("--demo-contexts", type=int, nargs="*", default=[2048, 8192, 32768])
    parser.add_argument("--m3-contexts", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--greedy-lengths", type=int, nargs="*", default=[1024, 2048, 4096])
    parser.add_argument("--greedy-tokens", type=int, default=16)
    parser.add_argument("--greedy-presets", nargs="*", default=["default"], choices=["default", "m3-attention"])
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "vllm-msa-fp8-agreement")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.contexts:
        print(f"random inputs, MiniMax-M3's layer shape, {args.tokens} decode queries per context\n{HEADER}")
        for seed, context in enumerate(args.contexts):
            start, agreement = time.perf_counter(), Agreement()
            agreement.add(random_inputs(M3_SHAPE, context, args.tokens, seed))
            print(agreement.row(context, time.perf_counter() - start), flush=True)
    models = build_models(args.models_dir) if args.demo_contexts or args.m3_contexts or args.greedy_lengths else {}
    for name, contexts in (("default", args.demo_contexts), ("m3-attention", args.m3_contexts)):
        if contexts:
            print(
                f"\nreal activations, demo checkpoint ({name} preset), {args.tokens} decode queries per layer\n{HEADER}"
            )
        for context in contexts:
            start, agreement = time.perf_counter(), Agreement()
            for inputs in captured_inputs(models[name], context, args.tokens):
                agreement.add(inputs)
            print(agreement.row(context, time.perf_counter() - start), flush=True)
    for name in args.greedy_presets if args.greedy_lengths else ():
        print(f"\ngreedy tokens, demo checkpoint ({name} preset), by cache format (the rest of the model in float32)")
        print_greedy_agreement(models[name], args.greedy_lengths, args.greedy_tokens)


if __name__ == "__main__":
    main()
