"""StepObserver: what FLASH_MSA observes of its MSA layers, in one hook: the sparse-layer metrics
(metrics.py) and the selection log (selection_log.py).

Each MSAAttention registers with OBSERVER when it is built, with its RankLayout, and runs every call as

    step = OBSERVER.layer_step(layer_name, device)    # times one call in metrics.SAMPLE_EVERY
    cache writes;  [FP8 K/V: step.count_saturated(...)];  step.mark();  block selection;  step.mark();  sparse attention
    step.done(selected, metadata)

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


class LayerStep:
    """One call of an MSA layer, as StepObserver.layer_step opened it."""

    def __init__(self, observer: "StepObserver", layer_name: str, clock: metrics.StageClock | None) -> None:
        self.observer = observer
        self.layer_name = layer_name
        self.clock = clock  # None: the call is not timed

    def mark(self) -> None:
        """A stage starts: the selection (after the cache writes), then the attention."""
        if self.clock is not None:
            self.clock.mark()

    def count_saturated(
        self, key: torch.Tensor, value: torch.Tensor, metadata: "FlashMSAMetadata", kv_scales: tuple[float, float]
    ) -> None:
        """The call wrote key/value [T, Hkv, D] to an FP8 K/V cache with these scales: count the values of its prompt
        (prefill) tokens that saturated; steps of decodes only are not counted (it would cost every decode step)."""
        plan = metadata.plan
        if plan.part("prefill") is None:
            return
        start, stop = plan.num_decode_tokens, metadata.num_actual_tokens
        self.observer.step_stats().count_saturated(key[start:stop], value[start:stop], kv_scales)

    def done(self, selected: torch.Tensor, metadata: "FlashMSAMetadata") -> None:
        """The call ended with this selection [T, Hi, K] (-1 = none), on the layer's metadata."""
        self.mark()
        self.observer.layer_done(self.layer_name, selected, metadata)


class StepObserver:
    """The MSA layers of this process and what observes them (the module docstring says what it decides)."""

    def __init__(self) -> None:
        self.layers: dict[str, RankLayout] = {}  # by layer name, in the order they were built
        self.model_name = ""
        self.logs_selection = False
        self.stats: metrics.StepStats | None = None  # created by the first layer call, on the model's device

    def register(self, layer_name: str, layout: RankLayout) -> None:
        """An MSA layer being built (under vLLM's config of its model)."""
        self.layers[layer_name] = layout
        self.model_name = str(compat.current_vllm_config().model_config.served_model_name)  # one name, once resolved
        self.logs_selection = compat.tensor_parallel_rank_and_size()[0] == 0

    def step_stats(self) -> metrics.StepStats:
        """The totals, which the first layer call created (layer_step)."""
        assert self.stats is not None, "a layer call records before its layer_step"
        return self.stats

    def layer_step(self, layer_name: str, device: torch.device) -> LayerStep:
        if self.stats is None:
            self.stats = metrics.StepStats(device, self.model_name)
        return LayerStep(self, layer_name, self.stats.clock())

    def layer_done(self, layer_name: str, selected: torch.Tensor, metadata: "FlashMSAMetadata") -> None:
        plan = metadata.plan
        batch = plan.batch
        last = next(reversed(self.layers))
        if layer_name == last and self.layers[last].counts_selections:
            block_size = self.layers[last].shape.block_size
            stats = self.step_stats()
            stats.record(selected, batch.positions, block_size, plan.num_decode_tokens, layers=len(self.layers))
            stats.publish()
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
