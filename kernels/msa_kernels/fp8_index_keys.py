"""FP8 index keys (`indexer_kv_dtype` fp8): the e4m3 page layout with per-token scales, and the quantisation.

Page layout, one page of B tokens x Hki index-key heads x Dp:

    bytes [0, B*Hki*Dp)                 e4m3 values [B, Hki, Dp], row-major: one Dp-byte row per (token, head)
    bytes [B*Hki*Dp, B*Hki*(Dp + 4))    float32 scales [B, Hki]

It is vLLM's FP8 indexer-key page (DeepSeek-V3.2's `indexer_k_quant_and_cache` layout: values, then one
float32 scale per `quant_block_size` elements of a token, here quant_block_size = Dp), so for Hki 1 and
Dp 128 (MiniMax-M3) vLLM's CUDA op writes exactly these bytes. Why this layout and this granularity:

- The values of a page are one contiguous [B, Hki*Dp] byte matrix whose rows are K-major for the score
  GEMM (K = Dp): a Hopper kernel reads them with 16-byte loads or a TMA box of whole rows, and FP8
  warpgroup MMAs take them as they are (wgmma reads 8-bit operands K-major only). The scales follow as
  one 16-byte-aligned [B, Hki] float32 run (B*Hki*Dp is a multiple of 16), read once per page.
- One scale per (token, index-key head) is the finest granularity that factors out of the dot product:
  q . k[j] = q_scale * k_scale[j] * (q8 . k8[j]), so the MMA runs on raw e4m3 and the scale costs one
  multiply per score in the epilogue. A scale per 32 or 64 elements would have to be applied inside the
  K loop; one per tensor or a fixed one (vLLM's own M3 FP8 index cache stores unscaled e4m3) needs
  calibration and wastes range on tokens with small keys. A per-token scale is also computed from the
  token alone, so the bytes cached for a token do not depend on how its request was chunked, preempted
  or prefix-cached.

Quantisation of a row x (a token's index key for one head, or one index query row): scale = max(amax(|x|),
1e-4) / 448 in float32, values = e4m3(x / scale), rounded to nearest even and saturated at +-448 (vLLM's op:
cvt with satfinite); both divisions IEEE float32 ones, on every device, so the CuTeDSL kernels
(msa_kernels/cute/fp8_rows.py) round bit for bit as quantize_rows does. Index scores with FP8 index keys quantise
the index queries the same way per (token, index head), as FP8 MMAs need both operands in e4m3; the query
scale is one positive factor per (token, head), so it does not change which blocks rank highest
(reference.index_block_scores is the function). Decode, whose kernel could keep bf16 queries, rounds them too:
one function for both phases, so a token recomputed in a prefill chunk after a preemption selects what it
selected in decode.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-4  # rows with a smaller amax get this one's scale (vLLM's floor): no division by zero
SCALE_BYTES = 4  # one float32 per (token, index-key head)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (e4m3 values [..., d], float32 scales [...]): one scale per row of d elements."""
    x = x.float()
    amax = x.abs().amax(dim=-1).clamp(min=MIN_AMAX)
    # A tensor divisor, not the number: torch on CUDA multiplies by a float32 reciprocal of a number divisor,
    # which is 1 ulp off the division for many amax (the CPU divides, as the kernels do: div.rn.f32).
    scales = amax / torch.full_like(amax, E4M3_MAX)
    values = (x / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values, scales


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 values [..., d] x float32 scales [...] -> float32 [..., d]."""
    return values.float() * scales.unsqueeze(-1)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as FP8 represents it, in float32: dequantize_rows(*quantize_rows(x))."""
    return dequantize_rows(*quantize_rows(x))


def page_bytes(block_size: int, num_key_heads: int, head_dim: int) -> int:
    """Bytes of one FP8 index-key page: the e4m3 values, then the float32 scales."""
    return block_size * num_key_heads * (head_dim + SCALE_BYTES)


@dataclass(frozen=True)
class Fp8IndexKeyCache:
    """An FP8 paged index-key cache: views of the pages' e4m3 values and float32 scales (the layout above).

    Where a bf16 index-key cache is a tensor [num_pages, B, Hki, Dp], an FP8 one is this object, so no
    implementation can take its bytes for bf16: msa_kernels.ops routes it by `dtype`, which the CuTeDSL
    kernels' can_implement refuses.
    """

    values: torch.Tensor  # [num_pages, B, Hki, Dp] float8_e4m3fn
    scales: torch.Tensor  # [num_pages, B, Hki] float32
    dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn

    @classmethod
    def from_pages(cls, pages: torch.Tensor, block_size: int, num_key_heads: int, head_dim: int) -> "Fp8IndexKeyCache":
        """Views of raw pages: uint8 [num_pages, ...] holding page_bytes(...) contiguous bytes per page (the page
        stride may be larger)."""
        pages = pages.flatten(1)
        if pages.dtype != torch.uint8 or pages.shape[1] != page_bytes(block_size, num_key_heads, head_dim):
            raise ValueError(
                f"FP8 index-key pages must be uint8 [num_pages, {page_bytes(block_size, num_key_heads, head_dim)}], "
                f"got {pages.dtype} {list(pages.shape)}"
            )
        split = block_size * num_key_heads * head_dim
        values = pages[:, :split].view(torch.float8_e4m3fn).unflatten(1, (block_size, num_key_heads, head_dim))
        scales = pages[:, split:].view(torch.float32).unflatten(1, (block_size, num_key_heads))
        return cls(values, scales)

    @classmethod
    def quantize(cls, index_key_cache: torch.Tensor) -> "Fp8IndexKeyCache":
        """The FP8 cache of the keys of an index-key cache [num_pages, B, Hki, Dp] (e.g. bf16), page for page."""
        return cls(*quantize_rows(index_key_cache))

    def dequantize(self, pages: torch.Tensor) -> torch.Tensor:
        """The index keys of these pages, float32 [len(pages), B, Hki, Dp]."""
        return dequantize_rows(self.values[pages], self.scales[pages])
