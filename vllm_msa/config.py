"""The `msa_config` block of a Flash-MSA checkpoint's config.json: parsing, validation, per-layer shapes.

    "msa_config": {"block_size": 128, "topk_blocks": 16, "local_blocks": 1, "init_blocks": 0,
                   "num_index_heads": 4, "num_index_key_heads": 1, "index_head_dim": 128,
                   "dense_layers": [0, 1, 2], "indexer_kv_dtype": "auto"}

Layers listed in dense_layers run plain dense attention; every other layer is an MSA layer.
MiniMax-M3 checkpoints describe the same things in their own `sparse_attention_config`
(MSAModelConfig.from_minimax_m3, from the fields vLLM's in-tree M3 reads).

indexer_kv_dtype is the index-key cache's format, with the values of vLLM's option of that name (which
vLLM's MiniMax-M3 reads from `--attention-config '{"indexer_kv_dtype": ...}'`): auto (the K/V cache's
dtype, the model's), bf16, fp8 / fp8_e4m3 (e4m3 with a float32 scale per token and index-key head:
msa_kernels.fp8_index_keys). `--attention-config` sets it for any model FLASH_MSA serves; otherwise a
FlashMSAForCausalLM checkpoint's msa_config.indexer_kv_dtype does (served_indexer_kv_dtype).

check_serving_config() runs in vLLM's API server process while it builds its config (vLLM's
per-architecture hook, registered by registration.py), so a checkpoint or flag FLASH_MSA cannot
serve stops `vllm serve` before any engine process starts, with a message naming the fix. That
includes a KV connector (--kv-transfer-config, --kv-offloading-size) no run has shown to carry the
index-key caches with the K/V (VERIFIED_KV_CONNECTORS), and a host tier (--additional-config
flash_msa_kv_device_pages: host_tier.py) too small for one decode step or beside what it does not run with.
"""

import os
from dataclasses import MISSING, dataclass, fields, replace
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from msa_kernels.fp8_index_keys import Fp8IndexKeyCache
from msa_kernels.reference import FP8_KV_STORAGE
from msa_kernels.shapes import MSAShape
from vllm_msa import compat

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig

logger = init_logger("vllm.msa")  # under "vllm" so vLLM's log handlers print it

SERVED_BLOCK_SIZES = (128,)  # tokens per MSA block (== KV page) the FLASH_MSA backend serves
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # an e4m3 K/V cache with a scale per tensor (vLLM's FP8 K/V cache)
FP8_KV_DEVICES = ("cpu", "cuda")  # where FLASH_MSA serves one
SERVED_CACHE_DTYPES = ("auto", "float16", "bfloat16", *FP8_CACHE_DTYPES)  # --kv-cache-dtype values FLASH_MSA serves
# indexer_kv_dtype values FLASH_MSA serves (vLLM's names) and the index-key cache dtype of each; auto: the K/V cache's
INDEX_KEY_DTYPES = {"bf16": torch.bfloat16, "fp8": Fp8IndexKeyCache.dtype, "fp8_e4m3": Fp8IndexKeyCache.dtype}
SERVED_INDEXER_KV_DTYPES = ("auto", *INDEX_KEY_DTYPES)
# KV connectors whose transfer of FLASH_MSA's caches (each MSA layer's K/V and its index-key cache) a run has shown
# right: ExampleConnector (tests/test_kv_connector.py on CPU, dev/gpu/kv_connectors.py on the GPU), vLLM's CPU offload
# (--kv-offloading-size, a GPU feature: dev/gpu/kv_connectors.py --checks offload, the index keys among the bytes it
# moves); any other stops `vllm serve` unless named in UNVERIFIED_KV_CONNECTORS_ENV.
VERIFIED_KV_CONNECTORS = ("ExampleConnector", "OffloadingConnector")
UNVERIFIED_KV_CONNECTORS_ENV = "FLASH_MSA_UNVERIFIED_KV_CONNECTORS"  # comma-separated names, accepted with a warning
KV_DEVICE_PAGES_OPTION = "flash_msa_kv_device_pages"  # --additional-config key: the host tier's device pages a layer


def _is_int(value) -> bool:
    """A JSON integer (bool is an int to Python, not to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


class MSAConfigError(ValueError):
    """A checkpoint's MSA fields cannot be served; the message names the field and the fix."""


@dataclass(frozen=True)
class MSAModelConfig:
    block_size: int
    topk_blocks: int
    num_index_heads: int
    index_head_dim: int
    num_index_key_heads: int = 1
    local_blocks: int = 1
    init_blocks: int = 0
    dense_layers: tuple[int, ...] = ()
    indexer_kv_dtype: str = "auto"

    @classmethod
    def from_hf_config(cls, hf_config: "PretrainedConfig") -> "MSAModelConfig":
        raw = getattr(hf_config, "msa_config", None)
        if not isinstance(raw, dict):
            raise MSAConfigError(
                "this checkpoint has no 'msa_config' in config.json, so it has no MSA layers to serve; "
                "add the block described in the vllm-msa README or serve it without FlashMSAForCausalLM"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise MSAConfigError(f"msa_config has unknown fields {unknown}; known fields: {sorted(known)}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.name not in raw]
        if required:
            raise MSAConfigError(f"msa_config is missing {required}")
        values = dict(raw)
        for name, value in values.items():
            if name == "dense_layers":
                if not isinstance(value, list) or not all(_is_int(i) for i in value):
                    raise MSAConfigError(f"msa_config.dense_layers must be a list of layer indices, got {value!r}")
                values[name] = tuple(value)
            elif name == "indexer_kv_dtype":
                if not isinstance(value, str):
                    raise MSAConfigError(f"msa_config.indexer_kv_dtype must be a string, got {value!r}")
            elif not _is_int(value):
                raise MSAConfigError(f"msa_config.{name} must be an integer, got {value!r}")
        if values.get("indexer_kv_dtype", "auto") not in SERVED_INDEXER_KV_DTYPES:
            raise MSAConfigError(
                f"msa_config.indexer_kv_dtype {values['indexer_kv_dtype']!r} is not served: FLASH_MSA keeps index keys "
                f"as one of {list(SERVED_INDEXER_KV_DTYPES)}"
            )
        config = cls(**values)
        num_layers = hf_config.num_hidden_layers
        bad = [i for i in config.dense_layers if not 0 <= i < num_layers]
        if bad:
            raise MSAConfigError(f"msa_config.dense_layers {bad} outside 0..{num_layers - 1}")
        config.layer_shape(hf_config)  # validates head counts and top-k against the model
        return config

    @classmethod
    def from_minimax_m3(cls, text_config: "PretrainedConfig") -> "MSAModelConfig":
        """MiniMax-M3's sparse-attention fields as vLLM reads them (compat.m3_sparse_fields) as MSA.

        One shared index key (Hki 1), index heads == KV heads (vLLM's fused M3 projection requires it),
        max-pooled block scores; layers not marked sparse are dense.
        """
        m3 = compat.m3_sparse_fields(text_config)
        if m3["source"] is None:
            raise MSAConfigError("this MiniMax-M3 config has no sparse-attention fields, so it has no sparse layers")
        if m3["missing"]:
            raise MSAConfigError(f"{m3['source']} is missing {m3['missing']}")
        names = m3["names"]
        if m3["score_type"] != "max":
            raise MSAConfigError(f"{names['score_type']} {m3['score_type']!r}: FLASH_MSA max-pools block scores")
        if m3["num_index_heads"] != text_config.num_key_value_heads:
            raise MSAConfigError(
                f"{names['num_index_heads']} {m3['num_index_heads']} != num_key_value_heads "
                f"{text_config.num_key_value_heads}: MiniMax-M3 scores one index head per KV head"
            )
        if m3["local_blocks"] < 1:
            raise MSAConfigError(f"{names['local_blocks']} must be >= 1: FLASH_MSA always reads the query's own block")
        config = cls(
            block_size=m3["block_size"],
            topk_blocks=m3["topk_blocks"],
            num_index_heads=m3["num_index_heads"],
            index_head_dim=m3["index_head_dim"],
            num_index_key_heads=1,
            local_blocks=m3["local_blocks"],
            init_blocks=m3["init_blocks"],
            dense_layers=tuple(i for i, sparse in enumerate(m3["sparse_layers"]) if not sparse),
        )
        config.layer_shape(text_config)
        return config

    def sparse_layers(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if self.is_sparse(i)]

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index not in self.dense_layers

    def rank_layout(self, hf_config: "PretrainedConfig", tp_size: int = 1, tp_rank: int = 0) -> "RankLayout":
        """What one tensor-parallel rank of an MSA layer holds. Heads split as vLLM splits attention heads:
        query heads evenly; KV, index and index-key heads evenly where the TP size divides their count,
        else (a count that divides the TP size) replicated, head h on the TP/count consecutive ranks from
        h * TP/count (vLLM's KV-head rule). A rank's query heads then find the KV and index heads serving
        them on the same rank, so it selects blocks for exactly the query heads it owns."""
        full = self.layer_shape(hf_config)
        if full.num_q_heads % tp_size:
            raise MSAConfigError(
                f"num_attention_heads {full.num_q_heads} is not divisible by --tensor-parallel-size {tp_size}"
            )
        kv = _rank_heads(full.num_kv_heads, tp_size, tp_rank, "num_key_value_heads")
        index = _rank_heads(full.num_index_heads, tp_size, tp_rank, "the index heads (num_index_heads)")
        index_keys = _rank_heads(
            full.num_index_key_heads, tp_size, tp_rank, "the index key heads (num_index_key_heads)"
        )
        try:
            shape = replace(
                full,
                num_q_heads=full.num_q_heads // tp_size,
                num_kv_heads=len(kv),
                num_index_heads=len(index),
                num_index_key_heads=len(index_keys),
            )
        except ValueError as e:
            raise MSAConfigError(f"msa_config cannot be split over --tensor-parallel-size {tp_size}: {e}") from None
        replicas = max(1, tp_size // full.num_index_heads)  # ranks holding the same index heads
        return RankLayout(shape, index, index_keys, counts_selections=tp_rank % replicas == 0)

    def layer_shape(self, hf_config: "PretrainedConfig") -> MSAShape:
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        try:
            return MSAShape(
                num_q_heads=num_heads,
                num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
                head_dim=head_dim,
                num_index_heads=self.num_index_heads,
                num_index_key_heads=self.num_index_key_heads,
                index_head_dim=self.index_head_dim,
                topk_blocks=self.topk_blocks,
                local_blocks=self.local_blocks,
                init_blocks=self.init_blocks,
                block_size=self.block_size,
            )
        except ValueError as e:
            raise MSAConfigError(f"msa_config does not fit this model: {e}") from None


@dataclass(frozen=True)
class RankLayout:
    """One tensor-parallel rank's part of an MSA layer (MSAModelConfig.rank_layout)."""

    shape: MSAShape  # the rank's head counts
    index_heads: range  # the layer's index heads this rank computes
    index_key_heads: range  # the layer's index key heads this rank caches
    counts_selections: bool  # the first rank of those index heads' replicas: the one that counts them (observer.py)

    def describe(self, tp_size: int) -> str:
        s = self.shape
        return (
            f"per rank of {tp_size}: Hq {s.num_q_heads}, Hkv {s.num_kv_heads}, index heads {s.num_index_heads}, "
            f"index key heads {s.num_index_key_heads}"
        )


def _rank_heads(total: int, tp_size: int, tp_rank: int, what: str) -> range:
    if total >= tp_size:
        if total % tp_size:
            raise MSAConfigError(f"{what} {total} is not divisible by --tensor-parallel-size {tp_size}")
        per_rank = total // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % total:
        raise MSAConfigError(f"--tensor-parallel-size {tp_size} is neither a divisor nor a multiple of {what} {total}")
    head = tp_rank // (tp_size // total)
    return range(head, head + 1)


def served_indexer_kv_dtype(vllm_config: "VllmConfig", msa: MSAModelConfig) -> str:
    """The index-key cache format of this model: `--attention-config` indexer_kv_dtype where given (not auto),
    else the model's (msa_config.indexer_kv_dtype; auto for MiniMax-M3). Refuses a value FLASH_MSA does not
    serve, naming the option."""
    option = vllm_config.attention_config.indexer_kv_dtype
    if option == "auto":
        return msa.indexer_kv_dtype
    if option not in SERVED_INDEXER_KV_DTYPES:
        raise MSAConfigError(
            f"--attention-config indexer_kv_dtype {option!r} is not served: FLASH_MSA keeps index keys as one of "
            f"{list(SERVED_INDEXER_KV_DTYPES)}"
        )
    return option


def index_key_dtype(indexer_kv_dtype: str, kv_cache_dtype: torch.dtype) -> torch.dtype:
    """The index-key cache's dtype for an indexer_kv_dtype value: auto gives the K/V cache's (an FP8 K/V cache: FP8
    index keys); Fp8IndexKeyCache.dtype stands for an FP8 cache (e4m3 pages with per-token scales)."""
    if indexer_kv_dtype != "auto":
        return INDEX_KEY_DTYPES[indexer_kv_dtype]
    return Fp8IndexKeyCache.dtype if kv_cache_dtype == FP8_KV_STORAGE else kv_cache_dtype


def served_index_key_dtype(vllm_config: "VllmConfig", msa: MSAModelConfig) -> torch.dtype:
    """The dtype of this model's index-key caches (served_indexer_kv_dtype against its K/V cache's dtype)."""
    kv_cache_dtype = compat.cache_torch_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config)
    return index_key_dtype(served_indexer_kv_dtype(vllm_config, msa), kv_cache_dtype)


def m3_fused_op_writes_caches(kv_cache_dtype: str, index_key_dtype: torch.dtype) -> bool:
    """Whether vLLM's fused M3 norm/RoPE op stores an M3 layer's K/V and index keys in FLASH_MSA's caches: it keeps
    them as vLLM's own M3 backend does, a bf16/fp16 K/V cache in vLLM's layout (FLASH_MSA's too, kv_cache_dtype
    "auto") and a bf16/fp16 index-key cache. An FP8 cache of either keeps FLASH_MSA's writes: its checkpoint K/V
    scales, its FP8 index-key pages (e4m3 values and float32 scales, bytes the op would take for its NVFP4 pages and
    refuse)."""
    return kv_cache_dtype == "auto" and index_key_dtype in (torch.bfloat16, torch.float16)


def flash_msa_selected(vllm_config: "VllmConfig") -> bool:
    """Whether `--attention-backend FLASH_MSA` was given."""
    return getattr(vllm_config.attention_config.backend, "name", None) == "FLASH_MSA"


def check_serving_config(vllm_config: "VllmConfig") -> None:
    """Validate msa_config, --block-size, the tensor-parallel split and the KV connectors for FlashMSAForCausalLM;
    pin the block size. Pipeline parallelism splits layers, which MSA layers allow as any others."""
    hf_config = vllm_config.model_config.hf_config
    msa = MSAModelConfig.from_hf_config(hf_config)
    _check_cache(vllm_config, msa)
    layout = msa.rank_layout(hf_config, vllm_config.parallel_config.tensor_parallel_size)
    if msa.sparse_layers(hf_config.num_hidden_layers):  # else no index-key caches (a dense baseline)
        _check_kv_connectors(vllm_config)
        check_kv_device_pages(vllm_config, layout.shape)


def check_minimax_m3_serving_config(vllm_config: "VllmConfig") -> None:
    """The same for MiniMax-M3 under FLASH_MSA; with any other backend vLLM's own M3 path runs untouched.

    vLLM captures M3 with its breakable CUDA graphs: FLASH_MSA's MSA op is an eager break of those
    (vllm_msa/layer.py) and its cache writes are capturable, so M3 keeps vLLM's CUDA graphs.
    """
    if not flash_msa_selected(vllm_config):
        return
    text_config = vllm_config.model_config.hf_text_config
    msa = MSAModelConfig.from_minimax_m3(text_config)
    _check_cache(vllm_config, msa)
    layout = msa.rank_layout(text_config, vllm_config.parallel_config.tensor_parallel_size)
    _check_kv_connectors(vllm_config)
    check_kv_device_pages(vllm_config, layout.shape)


def _check_cache(vllm_config: "VllmConfig", msa: MSAModelConfig) -> None:
    if msa.block_size not in SERVED_BLOCK_SIZES:
        raise MSAConfigError(
            f"msa_config.block_size {msa.block_size} is not served: FLASH_MSA keeps one MSA block per KV page "
            f"and serves blocks of {list(SERVED_BLOCK_SIZES)} tokens"
        )
    cache = vllm_config.cache_config
    if cache.user_specified_block_size and cache.block_size != msa.block_size:
        raise MSAConfigError(
            f"FLASH_MSA keeps one MSA block per KV page: serve this model with --block-size "
            f"{msa.block_size} (its msa_config.block_size), not {cache.block_size}"
        )
    if cache.cache_dtype not in SERVED_CACHE_DTYPES:
        raise MSAConfigError(
            f"FLASH_MSA keeps K/V in the model's dtype or in e4m3: --kv-cache-dtype {cache.cache_dtype} is not served; "
            f"leave it out (or use one of {list(SERVED_CACHE_DTYPES)}). FP8 index keys: --attention-config "
            '\'{"indexer_kv_dtype": "fp8"}\''
        )
    if cache.cache_dtype in FP8_CACHE_DTYPES:
        if (device_type := vllm_config.device_config.device_type) not in FP8_KV_DEVICES:
            raise MSAConfigError(
                f"--kv-cache-dtype {cache.cache_dtype} is served on {' and '.join(FP8_KV_DEVICES)} only: FLASH_MSA "
                f"writes and reads e4m3 K/V pages there, not on {device_type}; leave it out"
            )
        if (fp8 := compat.platform_fp8_dtype()) != torch.float8_e4m3fn:
            raise MSAConfigError(
                f"--kv-cache-dtype {cache.cache_dtype}: vLLM writes {fp8} K/V pages on this platform and FLASH_MSA "
                "reads float8_e4m3fn ones; leave it out"
            )
    served_indexer_kv_dtype(vllm_config, msa)
    cache.block_size = msa.block_size
    cache.user_specified_block_size = True  # keeps platform and backend defaults from changing it


def kv_connectors(vllm_config: "VllmConfig") -> list[tuple[str, str]]:
    """(connector, the option that runs it) for every KV connector this config runs: --kv-transfer-config's (each
    connector of a MultiConnector) and the one --kv-offloading-size adds (vLLM names it after this check runs)."""
    named = []
    if (transfer := vllm_config.kv_transfer_config) is not None and transfer.kv_connector:
        option = "--kv-transfer-config"
        if transfer.kv_connector == "MultiConnector":
            children = transfer.kv_connector_extra_config.get("connectors", [])
            named += [(child.get("kv_connector", "?"), f"{option} (MultiConnector)") for child in children]
        else:
            named.append((transfer.kv_connector, option))
    cache = vllm_config.cache_config
    if cache.kv_offloading_size is not None:
        offload = {"native": "OffloadingConnector", "lmcache": "LMCacheMPConnector"}
        named.append((offload.get(cache.kv_offloading_backend, cache.kv_offloading_backend), "--kv-offloading-size"))
    return named


def _check_kv_connectors(vllm_config: "VllmConfig") -> None:
    """Refuse a KV connector no test has shown to carry each MSA layer's index-key cache with its K/V: one that
    moves the K/V alone leaves the index keys of another request there, and long prompts then select the wrong
    blocks, silently (short prompts, where every block is selected, hide it)."""
    accepted = {name.strip() for name in os.environ.get(UNVERIFIED_KV_CONNECTORS_ENV, "").split(",") if name.strip()}
    for connector, option in kv_connectors(vllm_config):
        if connector in VERIFIED_KV_CONNECTORS:
            continue
        if connector in accepted:
            logger.warning(
                "FLASH_MSA: KV connector %s (%s) is not verified to carry MSA layers' index-key caches; accepted "
                "because %s names it. If it moves K/V without the index keys, long prompts select wrong blocks",
                connector,
                option,
                UNVERIFIED_KV_CONNECTORS_ENV,
            )
            continue
        raise MSAConfigError(
            f"{option} runs KV connector {connector}, which is not verified to carry FLASH_MSA's caches: each MSA "
            "layer keeps its index keys in a cache of its own (<layer>.index_key_cache, pages of another size in "
            "the K/V's KV cache group), and a connector that moves the K/V without them makes long prompts select "
            f"the wrong blocks, silently. Verified: {', '.join(VERIFIED_KV_CONNECTORS)}. To run {connector} anyway "
            f"(and check its answers), set {UNVERIFIED_KV_CONNECTORS_ENV}={connector}"
        )


def kv_device_pages(vllm_config: "VllmConfig") -> int | None:
    """The host tier's device pages per MSA layer (--additional-config '{"flash_msa_kv_device_pages": N}'), None
    without the tier (vllm_msa/host_tier.py)."""
    additional = vllm_config.additional_config
    return additional.get(KV_DEVICE_PAGES_OPTION) if isinstance(additional, dict) else None


def check_kv_device_pages(vllm_config: "VllmConfig", shape: MSAShape) -> None:
    """Refuse a host tier FLASH_MSA cannot serve: N not a positive integer, fewer device pages than one decode step of
    --max-num-seqs requests can read (requests x index heads x top-k: a step's every page must fit), and what does
    not run with the tier yet (speculative decoding, KV connectors)."""
    pages = kv_device_pages(vllm_config)
    if pages is None:
        return
    option = f"--additional-config '{{\"{KV_DEVICE_PAGES_OPTION}\": N}}'"
    if not _is_int(pages) or pages < 1:
        raise MSAConfigError(f"{option}: N is the device pages of each MSA layer, a positive integer, not {pages!r}")
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    step_pages = max_num_seqs * shape.num_index_heads * shape.topk_blocks
    if pages < step_pages:
        raise MSAConfigError(
            f"{option}: {pages} device pages cannot hold one decode step's pages: --max-num-seqs {max_num_seqs} "
            f"requests x {shape.num_index_heads} index heads x top-{shape.topk_blocks} = {step_pages}; give N >= "
            f"{step_pages} or a smaller --max-num-seqs"
        )
    if vllm_config.speculative_config is not None:
        raise MSAConfigError(f"{option}: FLASH_MSA's host tier does not run speculative decoding yet; leave one out")
    if connectors := kv_connectors(vllm_config):
        raise MSAConfigError(
            f"{option}: FLASH_MSA's host tier does not run KV connectors yet ({', '.join(n for n, _ in connectors)}); "
            "leave one out"
        )
