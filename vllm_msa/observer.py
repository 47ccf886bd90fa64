"""StepObserver: what FLASH_MSA observes of its MSA layers, in one hook: the sparse-layer metrics
(metrics.py) and the selection log (selection_log.py).

Each MSAAttention registers with OBSERVER when it is built, with its RankLayout, and runs every call as

    clock = OBSERVER.stage_clock(device)    # a metrics.StageClock for one call in metrics.SAMPLE_EVERY, else None
    cache writes;  [FP8 K/V: OBSERVER.count_saturated(...)];  [clock.mark()];  block selection;  [clock.mark()];
    sparse attention;  OBSERVER.layer_done(layer_name, selected, metadata, clock)

The observer decides the rest by itself, per worker process:
  - The last MSA layer registered is the process's last: vLLM builds a model's layers in order, and a
    pipeline stage builds its own only. Its selection is counted for all the process's MSA layers
    (every MSA layer of a model has the same shape and selects min(K, visible blocks) blocks per token
    and index head whatever the scores, so one layer's counts are every layer's); then the totals are
    published. Under pipeline parallelism each stage counts its own layers: the stages add up to the model.
  - Whether the process counts: RankLayout.counts_selections, one tensor-parallel rank per set of index
    heads, so ranks holding the same (replicated) index heads count them once.
  - Whether it logs selections: tensor-parallel rank 0, every MSA layer, for the requests marked for the log.
The metadata builder calls before_step() every step: a step replayed from a full CUDA graph records on
the device but runs no Python, so its totals are published from there.
"""

from typing import TYPE_CHECKING

import torch

from vllm_msa import compat, metrics, selection_log
from vllm_msa.config import RankLayout

if TYPE_CHECKING:
    from vllm_msa.backend import FlashMSAMetadata


class StepObserver:
    """The MSA layers of this process and what observes them (the module docstring says what it decides)."""

    def __init__(self) -> None:
        self.layers: dict[str, RankLayout] = {}  # by layer name, in the order they were built
        self.model_name = ""
        self.logs_selection = False
        self.stats: metrics.StepStats | None = None  # created by the first layer call (stage_clock)

    def register(self, layer_name: str, layout: RankLayout) -> None:
        """An MSA layer being built (under vLLM's config of its model)."""
        self.layers[layer_name] = layout
        self.model_name = str(compat.current_vllm_config().model_config.served_model_name)  # one name, once resolved
        self.logs_selection = compat.tensor_parallel_rank_and_size()[0] == 0

    def stage_clock(self, device: torch.device) -> metrics.StageClock | None:
        """A layer call starts (its cache writes first): a StageClock if the call is timed, else None. The first call
        creates the totals, on the model's device."""
        if self.stats is None:
            self.stats = metrics.StepStats(device, self.model_name)
        return self.stats.clock()

    def count_saturated(
        self, key: torch.Tensor, value: torch.Tensor, metadata: "FlashMSAMetadata", kv_scales: tuple[float, float]
    ) -> None:
        """A layer call wrote key/value [T, Hkv, D] to an FP8 K/V cache with these scales: count the values of its
        prompt (prefill) tokens that saturated; steps of decodes only are not counted (it would cost every decode
        step)."""
        plan = metadata.plan
        if plan.part("prefill") is None:
            return
        assert self.stats is not None, "a layer call counts after its stage_clock"
        start, stop = plan.num_decode_tokens, metadata.num_actual_tokens
        self.stats.count_saturated(key[start:stop], value[start:stop], kv_scales)

    def count_host_tier(self, hits: torch.Tensor, misses: torch.Tensor, page_bytes: int) -> None:
        """A layer call's decode part read hits pages from its device tier and copied misses pages of page_bytes
        in from host memory ([] int32 each, on the device: host_tier.py)."""
        assert self.stats is not None, "a layer call counts after its stage_clock"
        self.stats.count_host_tier(hits, misses, page_bytes)

    def layer_done(
        self,
        layer_name: str,
        selected: torch.Tensor,
        metadata: "FlashMSAMetadata",
        clock: metrics.StageClock | None = None,
    ) -> None:
        """A layer call ended with this selection [T, Hi, K] (-1 = none), on the layer's metadata; clock: its
        stage_clock, marked at the selection's and the attention's starts."""
        if clock is not None:
            clock.mark()
        plan = metadata.plan
        batch = plan.batch
        last = next(reversed(self.layers))
        if layer_name == last and self.layers[last].counts_selections:
            block_size = self.layers[last].shape.block_size
            assert self.stats is not None, "a layer call ends after its stage_clock"
            self.stats.record(selected, plan.positions, block_size, plan.num_decode_tokens, layers=len(self.layers))
            self.stats.publish()
        if (  # the capture query (a CUDA call) only where a selection is to be logged
            selection_log.labels_by_key
            and self.logs_selection
            and not (selected.is_cuda and torch.cuda.is_current_stream_capturing())  # no host copy in a capture
        ):
            selection_log.log_selection(
                layer_name, selected, batch.query_start_loc_cpu, batch.seq_lens, metadata.request_keys
            )

    def before_step(self) -> None:
        """Publish what the MSA layers recorded so far (the metadata builder calls it every step, also before a
        step that replays a full CUDA graph, which records on the device but runs no Python)."""
        if self.stats is not None:
            self.stats.publish()


OBSERVER = StepObserver()  # one per process, as the metrics file and the selection log's marked requests
