"""FLASH_MSA's host tier for K/V: each MSA layer's K/V pages in host memory, the pages its decode steps read copied
into a device tier of N pages (`--additional-config '{"flash_msa_kv_device_pages": N}'`; off without it).

An MSA decode step reads every block's index keys but the K/V of at most Hi x K blocks per request, and the next
step reads mostly the same ones (results/README.md, "Selection reuse across decode steps"). With the tier:
- vLLM budgets and allocates each MSA layer's K/V as a placeholder page of a few bytes (resident_kv_spec), so its
  GPU memory goes to index keys, dense layers and more pages; the index-key caches stay on the GPU, in the same KV
  cache group, so vLLM's block table, prefix cache and preemption work as without the tier.
- When vLLM binds the placeholder, the layer allocates its LayerHostTier: the K/V of all vLLM's pages in host memory
  (pinned on a GPU host, written and read by the kernels through its device view: vLLM's UVA view of pinned memory)
  and the device tier, N pages on the model's device, with a PageCache (msa_kernels.host_tier) saying which host
  page each holds, replaced by the CLOCK policy (least recently used, approximately).
- A step's K/V writes go to the host pages and, where a device page holds a copy of the page, to the copy too.
  The prefill part's attention reads the host pages (prefill reads whole prompts once). The decode part's
  selection is resolved to device pages (msa_kernels.ops.page_resolver: hits keep their page, misses take the slots
  the clock hand picks; one kernel launch on Hopper), the missed pages copied in (msa_kernels.ops.page_copier: only
  those cross PCIe), and the decode attention runs unchanged on the device pages with the resolved block table.

Every kernel reads the same values as without the tier, so the tokens are the same (tests/test_host_tier.py,
tests/test_vllm_engine.py -k host_tier).
Counted in /metrics: vllm:msa_kv_device_tier_hits_total, _misses_total, vllm:msa_kv_host_to_device_bytes_total.
Not with the tier (config.check_kv_device_pages refuses them by name): speculative decoding, KV connectors. A decode
step through the tier has no host sync and no data-dependent shapes (the resolve kernel or its torch ops, the page
copy kernel, the tier's block table made in the step's workspace), so decode batches keep their full CUDA graphs.
"""

from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from msa_kernels import ops, reference
from msa_kernels.host_tier import PageCache
from msa_kernels.plan import PlanPart, StepPlan, Workspace
from msa_kernels.shapes import MSAShape, PagedBatch
from vllm_msa import compat
from vllm_msa.config import MSAConfigError

HOST_MEMORY_SHARE = 0.9  # of the host memory available when the tier allocates: the most its pages may take


def resident_kv_spec(shape: MSAShape, dtype: torch.dtype) -> KVCacheSpec:
    """What vLLM budgets for an MSA layer's K/V with the host tier: one head of 8 elements a token (a placeholder
    page of B x 16 elements: its pages count in vLLM's block table, the K/V live in host memory)."""
    return FullAttentionSpec(block_size=shape.block_size, num_kv_heads=1, head_size=8, head_size_v=8, dtype=dtype)


def page_shape(shape: MSAShape) -> tuple[int, int, int]:
    """A K/V page as vLLM's FlashAttention layout holds it: [Hkv, B, 2 * D] (reference.kv_planes views it)."""
    return shape.num_kv_heads, shape.block_size, 2 * shape.head_dim


def page_bytes(shape: MSAShape, dtype: torch.dtype) -> int:
    """Bytes of one such page in this dtype."""
    return torch.Size(page_shape(shape)).numel() * dtype.itemsize


@dataclass
class LayerHostTier:
    """One MSA layer's K/V: host_pages [vLLM's pages, Hkv, B, 2D] in host memory (pinned on a GPU host), host_view
    the tensor the kernels read and write them through (its device view on a GPU, itself on CPU), device_pages
    [N, Hkv, B, 2D] on the model's device and cache, the PageCache of which host page each holds; resolve_step and
    copy_pages what resolves a decode step and copies its missed pages in on this device (chosen once)."""

    host_pages: torch.Tensor
    host_view: torch.Tensor
    device_pages: torch.Tensor
    cache: PageCache
    resolve_step: Callable[..., tuple[torch.Tensor, ...]]  # ops.page_resolver's choice
    copy_pages: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]  # ops.page_copier's choice

    @classmethod
    def allocate(
        cls,
        num_pages: int,
        num_device_pages: int,
        shape: MSAShape,
        dtype: torch.dtype,
        device: torch.device,
        layers_to_allocate: int = 1,
    ) -> "LayerHostTier":
        """The tier of a layer whose placeholder cache vLLM bound with num_pages pages; layers_to_allocate: the MSA
        layers of this process whose tiers are still to be allocated, this one included (each takes as much host
        memory), so the first refuses what all of them would not fit, before any is pinned."""
        page = page_shape(shape)
        page_size = page_bytes(shape, dtype)
        available = psutil.virtual_memory().available
        if layers_to_allocate * num_pages * page_size > HOST_MEMORY_SHARE * available:
            fits = int(HOST_MEMORY_SHARE * available // (layers_to_allocate * page_size))
            total = layers_to_allocate * num_pages * page_size
            raise MSAConfigError(
                f"FLASH_MSA's host tier: the K/V of {layers_to_allocate} MSA layers would take {layers_to_allocate} x "
                f"{num_pages} pages x {page_size} bytes ({total / 2**30:.1f} GiB) of host memory, past "
                f"{HOST_MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available: serve with "
                f"--num-gpu-blocks-override at most {fits} (vLLM sizes its pages by GPU memory, and with the tier an "
                "MSA layer's page takes almost none of it)"
            )
        pinned = device.type == "cuda"
        if pinned:
            free = torch.cuda.mem_get_info(device)[0]
            if num_device_pages * page_size > free:
                raise MSAConfigError(
                    f"FLASH_MSA's host tier: this MSA layer's device tier of {num_device_pages} pages x {page_size} "
                    f"bytes ({num_device_pages * page_size / 2**30:.2f} GiB) does not fit the "
                    f"{free / 2**30:.2f} GiB free on {device} after vLLM's KV cache (and the layers' tiers before "
                    "it): lower flash_msa_kv_device_pages, or leave room for the tiers with --kv-cache-memory-bytes "
                    "or a lower --gpu-memory-utilization"
                )
        host_pages = torch.empty((num_pages, *page), dtype=dtype, pin_memory=pinned)
        host_view = compat.device_view_of_host_tensor(host_pages) if pinned else host_pages
        device_pages = torch.empty((num_device_pages, *page), dtype=dtype, device=device)
        cache = PageCache.empty(num_device_pages, num_pages, device)
        resolver = ops.page_resolver(device, num_device_pages)
        return cls(host_pages, host_view, device_pages, cache, resolver, ops.page_copier(device))

    @property
    def page_bytes(self) -> int:
        return self.host_pages[0].numel() * self.host_pages.element_size()

    def device_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The device-tier slots [T] the K/V written at host slots slot_mapping [T] also go to (-1: none)."""
        return self.cache.device_slots(slot_mapping, self.host_pages.shape[2])

    def decode_part(self, plan: StepPlan, selected: torch.Tensor) -> tuple[PlanPart, torch.Tensor, torch.Tensor]:
        """Bring the pages the step's decode part reads (selected: the step's [T, Hi, K]) into the device tier: the
        part to attend on the device pages (its block table: the device page of each block the step reads), and
        the step's (hits, misses) [] int32 of this layer."""
        decode = plan.part("decode")
        assert decode is not None, "a step without decode tokens reads no device page"
        part = plan.workspace.launch("device tier part", _device_tier_part, decode)
        copy_from, copy_to, hits, misses = self.resolve_step(
            self.cache, decode.of(selected), decode.batch.block_table, part.batch.block_table
        )
        self.copy_pages(self.host_view, self.device_pages, copy_from, copy_to)
        return part, hits, misses


def _device_tier_part(decode: PlanPart) -> PlanPart:
    """The decode part of a step as the device tier serves it: its requests and rows, a block table of its own into
    which each layer resolves the device pages of the blocks it reads (the step's layers share it; the kernel leaves
    the other entries as it found them: the sparse attention reads the selected blocks' only), a workspace of its own
    (its launches bind that table)."""
    batch = decode.batch
    device_batch = PagedBatch(
        batch.query_start_loc,
        batch.seq_lens,
        torch.full_like(batch.block_table, -1),
        "decode",
        batch.query_start_loc_cpu,
    )
    return PlanPart(device_batch, decode.rows, Workspace(batch.block_table.device))


def kv_planes(tier: LayerHostTier) -> tuple[torch.Tensor, torch.Tensor]:
    """(host, device) K/V planes as the kernels take them (reference.kv_planes)."""
    return reference.kv_planes(tier.host_view), reference.kv_planes(tier.device_pages)
