"""Document masking (data.document_mask): packed rows whose documents do not see each other.

A row of the loader packs several documents, each ended by the end-of-document id; with document
masking the loader's `position_ids` (B, T) restart at 0 after each of them (megatron's
reset_position_ids). From them the model derives each position's document index

    doc_t = (number of positions s <= t with position_ids_s == 0)    (a running count)

and then, for a query at position t and a key at position j:
  - attention: j <= t and doc_j == doc_t (block-causal; Llama 3's intra-document mask);
  - the copy head: its candidates C_t (j <= t + shift) and doc_j == doc_t: nothing is pasted from
    another document;
  - positions (RoPE, learned) read position_ids instead of 0..T-1.
position_ids=None is one document a row: plain causal attention, positions 0..T-1 (the default).

A decode state keeps the positions and document indices of what it has been fed, so a packed
prompt can be prefilled in chunks and continued: a chunk given without position_ids continues the
last document (positions counting on from its last), one given with them may start new documents
(a 0) or continue (positions that do not start at 0: a later chunk, a context-parallel shard).

On CPU the block-causal attention is SDPA with an explicit boolean mask (B, 1, Tq, Tk); on CUDA
FlexAttention with a document mask_mod (its BlockMask skips the blocks between documents): the
kernel is chosen when the model is built (cplm_dist.model.core_attention), these are its masks.
"""

from __future__ import annotations

import torch

from cplm_dist.errors import UsageError
from cplm_dist.model.copy_lse import candidate_mask, document_candidates, flex_attention_call, query_positions


def check_positions(position_ids: torch.Tensor, input_ids: torch.Tensor, full_row: bool) -> None:
    """One line for position_ids that cannot be a document layout of input_ids. full_row: a
    training row (it must start a document at 0; decoding and chunks may start elsewhere),
    checked where the positions are on the CPU (on an accelerator the check would synchronise
    every step; the loader's rows start at 0 by construction)."""
    if tuple(position_ids.shape) != tuple(input_ids.shape):
        raise UsageError(f"position_ids of shape {tuple(position_ids.shape)} for input_ids of shape "
                          f"{tuple(input_ids.shape)}: give one position per token, (B, T)")
    if position_ids.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise UsageError(f"position_ids are {position_ids.dtype}: give integer positions (torch.long)")
    if full_row and has_values(position_ids) and position_ids.numel() and bool((position_ids[:, 0] != 0).any()):
        raise UsageError("position_ids of a training row must start at 0 (a row starts a document): "
                          "build them with reset_position_ids (data.document_mask=true) or pass position_ids=None")


def has_values(t: torch.Tensor) -> bool:
    """Whether `t`'s values can be read without a device synchronisation: on the CPU, and a real
    tensor (the dry run traces the model with fake tensors, which have shapes but no values)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "cpu" and not is_fake(t)


def document_index(position_ids: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) document index of each position: a running count of restarts (position 0), after
    the last index of `past` (B, P) when a decode state holds earlier positions."""
    starts = torch.cumsum((position_ids == 0).to(torch.int32), dim=1)
    return starts if past is None or past.shape[1] == 0 else starts + past[:, -1:]


def continued_positions(last: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) positions continuing a document whose last position is `last` (B, 1)."""
    return last + torch.arange(1, length + 1, device=last.device, dtype=last.dtype)


def block_causal_mask(docs: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """(B, 1, rows, Tk) bool for queries at positions offset.. against keys 0..Tk-1 whose document
    indices are docs (B, Tk): True where the key is at or before the query in its document (the
    copy head's candidate mask with no shift)."""
    return candidate_mask(query_positions(offset, rows, docs.device), docs.shape[1], 0, docs).unsqueeze(1)


def flex_document_mask(docs: torch.Tensor, offset: int, rows: int):
    """FlexAttention BlockMask of the block-causal mask (queries offset.., keys 0..Tk-1): the copy
    head's document candidates with no shift."""
    return document_candidates(rows, docs.shape[1], offset, offset, docs)


def flex_attend(q, k, v, block_mask, enable_gqa: bool, compiled: bool | None = None) -> torch.Tensor:
    """FlexAttention under a BlockMask: compiled (one fused kernel) on CUDA, the unfused eager
    reference elsewhere (forward only on CPU; what tests compare with SDPA)."""
    compiled = q.device.type == "cuda" if compiled is None else compiled
    return flex_attention_call(q, k, v, block_mask, compiled, enable_gqa=enable_gqa)
