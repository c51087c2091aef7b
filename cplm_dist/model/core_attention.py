"""The core attention: the kernel a layer's heads attend through, chosen once when the model is
built (megatron-core's `core_attention` slot of its layer spec, its backends picked in one place:
cplm_dist.model.parts.PartSpec.core_attention), the same object in every layer.

| kernel | chosen for | causal | document masking (block-causal) |
|---|---|---|---|
| `SDPAttention` | CPU | SDPA `is_causal` | SDPA under a boolean mask (B, 1, Tq, Tk) |
| `FlexAttention` | CUDA | SDPA `is_causal` (flash) | FlexAttention under a BlockMask (skips the blocks between documents) |
| `ContextParallelAttention` (model.parallel.context) | parallel.cp > 1 | K and V gathered over cp, each local chunk against its prefix | the same, block-causal |

What varies from call to call is passed as typed arguments, never told apart by its type:

    masks = kernel.masks(docs, offset, rows, device)   # once a forward: this kernel's own masks
    y = kernel(q, k, v, masks)                         # every layer, (B, nh, Tq, hd)

`docs` (B, offset + rows) is the document index of every key under document masking
(cplm_dist.model.documents), None for causal attention; `offset` is where the queries start among
the keys (a decode state's length: queries at offset.. see keys 0..offset + i). The decode state
(`cplm_dist.model.static_cache`) is written by the attention before the kernel sees the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cplm_dist.model.copy_lse import candidate_mask, query_positions
from cplm_dist.model.documents import block_causal_mask, flex_attend, flex_document_mask


@dataclass(frozen=True)
class Masks:
    """What one forward's layers hand the SDPA and Flex kernels: both None is causal attention
    (queries and keys the same positions, SDPA's is_causal)."""

    dense: torch.Tensor | None = None  # SDPA's boolean (.., rows, keys): True where a query sees a key
    block: object | None = None  # FlexAttention's BlockMask (CUDA)


class SDPAttention:
    """torch's scaled_dot_product_attention (flash / memory-efficient kernels on GPU, math on CPU)."""

    def masks(self, docs: torch.Tensor | None, offset: int, rows: int, device: torch.device) -> Masks:
        """The masks of `rows` queries at positions offset.. against keys 0..offset + rows - 1."""
        if docs is not None:  # block-causal: a key of the query's own document, at or before it
            return Masks(dense=block_causal_mask(docs, offset, rows))
        if offset == 0:
            return Masks()
        # a KV cache's continuation: query i sits at position offset + i and sees keys 0 .. offset + i
        return Masks(dense=candidate_mask(query_positions(offset, rows, device), offset + rows, 0))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: Masks) -> torch.Tensor:
        """q (B, nh, Tq, hd), k and v (B, nkv, Tk, hd) -> (B, nh, Tq, hd)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense, is_causal=masks.dense is None,
                                              enable_gqa=q.shape[1] != k.shape[1])


class FlexAttention(SDPAttention):
    """On CUDA: document masking through FlexAttention's BlockMask (one fused kernel that skips the
    blocks between documents); causal attention stays SDPA's (nothing to skip that flash skips not)."""

    def masks(self, docs: torch.Tensor | None, offset: int, rows: int, device: torch.device) -> Masks:
        if docs is None:
            return super().masks(docs, offset, rows, device)
        return Masks(block=flex_document_mask(docs, offset, rows))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: Masks) -> torch.Tensor:
        if masks.block is None:
            return super().__call__(q, k, v, masks)
        return flex_attend(q, k, v, masks.block, enable_gqa=q.shape[1] != k.shape[1])


def local_attention(device: torch.device) -> SDPAttention:
    """The kernel for one rank's whole sequence on `device`: FlexAttention's on CUDA, SDPA's elsewhere."""
    return FlexAttention() if device.type == "cuda" else SDPAttention()
