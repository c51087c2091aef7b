"""The copy head's per-head log-sum-exps A_t, M_t: the dense reference, the chunked path and the
fused FlexAttention kernel.

For one head, s_tj = q_t . k_j / sqrt(d_c) and (docs/copy_head.md)
    A_t = logsumexp_{j in C_t} s_tj,    M_t = logsumexp_{j in C_t, src_j = y_t} s_tj,
with C_t = {j <= t + shift} (shift -1 for paste `next`, 0 for `self`).

`dense_copy_lse` (copy.impl=dense) forms all (B, H, T, T) scores and autograd keeps about six
score-sized tensors alive at its peak; it is the reference every faster path is tested against.
`chunked_copy_lse` (copy.impl=chunked) walks the query rows in blocks of
`chunk`, keeps only q, k, A and M for backward and recomputes each block's scores there, as
flash attention does. The gradient of a log-sum-exp is its softmax, so for a row block

    dL/ds_tj = gA_t exp(s_tj - A_t) [j in C_t] + gM_t exp(s_tj - M_t) [j in C_t, src_j = y_t]
    dq_t = sum_j dL/ds_tj k_j / sqrt(d_c),   dk_j += sum_t dL/ds_tj q_t / sqrt(d_c)

Rows with no candidate (A_t = -inf) or no matching candidate (M_t = -inf) pass no gradient, as in
the dense path. A block only reads the keys its rows can see (j < r1 + shift), so the causal half
of the score matrix is never computed. Peak extra memory: a few (B, H, chunk, T) tensors.

`flex_copy_lse` (copy.impl=flex; `auto` trains with it on CUDA only once a GPU check has
recorded it for the installed torch, cplm_dist.model.flex_record, and chunked until then:
CopyHead.lse_path) computes each log-sum-exp as the LSE of one FlexAttention call
(torch.nn.attention.flex_attention, compiled to one Triton kernel): A_t with the mask j in C_t,
M_t with the mask j in C_t and src_j = y_t, evaluated inside the kernel from the ids.
FlexAttention's backward takes the gradient of its LSE, so the kernel's own recomputing backward
gives dq and dk; no (T, T) tensor exists. The attention output the kernel also makes is of zero
values `FLEX_VALUE_DIM` wide and is never read. On CPU FlexAttention runs forward only, unfused
(torch 2.13 refuses its backward there and cannot compile it with the LSE), so training on CPU
takes the chunked path.

All take an `offset`: the queries are positions offset .. offset + Tq - 1 of a sequence whose
keys are positions 0 .. Tk - 1 (a sequence-parallel rank's own rows against every key), and
`docs`: None, or under document masking the document index (B, Tk) of every position
(cplm_dist.model.documents), which adds doc_j == doc_t to C_t in every path (the flex kernels'
mask_mods read it; their BlockMask skips the blocks between documents).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from cplm_dist.model.loss import NEG_INF


def masked_logsumexp(x: torch.Tensor, mask: torch.Tensor | None, dim: int) -> torch.Tensor:
    """logsumexp over `dim` of the entries where mask is True; -inf with zero gradient where none.

    torch.logsumexp gives -inf forward but nan backward on an all -inf row; the where() guards
    keep those rows' gradients at exactly zero.
    """
    if mask is not None:
        x = x.masked_fill(~mask, NEG_INF)
    m = x.detach().amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp(x - m).sum(dim=dim, keepdim=True)
    nonempty = total > 0
    out = torch.where(nonempty, m + torch.log(torch.where(nonempty, total, torch.ones_like(total))), NEG_INF)
    return out.squeeze(dim)


def candidate_mask(queries: torch.Tensor, keys: int, shift: int, docs: torch.Tensor | None = None) -> torch.Tensor:
    """The one visibility rule: (Tq, keys) bool, [i, j] = key j is at or before queries[i] + shift
    (queries (Tq,): the query positions, a tensor so a compiled decode step takes a new one
    without recompiling); with the document index `docs` (B, >= keys, covering the queries) of
    document masking or a static cache's slots, (B, Tq, keys) and j in the query's document.
    shift 0 is attention's block-causal mask (cplm_dist.model.documents), -1 or 0 the copy
    head's C_t."""
    j = torch.arange(keys, device=queries.device)
    cand = j[None, :] <= queries[:, None] + shift
    if docs is None:
        return cand
    return cand & (docs[:, queries, None] == docs[:, None, :keys])


def query_positions(offset: int, rows: int, device) -> torch.Tensor:
    """(rows,) the positions offset .. offset + rows - 1: queries continuing `offset` earlier keys."""
    return torch.arange(offset, offset + rows, device=device)


def per_head(mask: torch.Tensor) -> torch.Tensor:
    """A (rows, keys) or (B, rows, keys) mask broadcastable against (B, H, rows, keys) scores."""
    return mask.unsqueeze(1) if mask.dim() == 3 else mask


def dense_copy_lse(q: torch.Tensor, k: torch.Tensor, src: torch.Tensor, labels: torch.Tensor | None,
                   shift: int, offset: int = 0, docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-head (A, M), each (B, H, Tq), from the full (B, H, Tq, Tk) scores; the arguments as
    `chunked_copy_lse`'s. Autograd keeps what backward needs."""
    Tq, Tk = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    cand = candidate_mask(query_positions(offset, Tq, q.device), Tk, shift, docs)  # (Tq, Tk), documents: (B, Tq, Tk)
    a_heads = masked_logsumexp(scores, per_head(cand), dim=-1)  # (B, H, Tq)
    if labels is None:
        return a_heads, None
    match = cand & (src.unsqueeze(1) == labels.unsqueeze(2))  # (B, Tq, Tk): j pastes y_t
    return a_heads, masked_logsumexp(scores, match.unsqueeze(1), dim=-1)


def _blocks(Tq: int, Tk: int, chunk: int, shift: int, offset: int):
    """(r0, r1, kend): query rows r0..r1-1 (positions offset + r0 ..) see keys 0..kend-1 at most."""
    for r0 in range(0, Tq, chunk):
        r1 = min(Tq, r0 + chunk)
        yield r0, r1, max(0, min(Tk, offset + r1 + shift))


def _block_masks(r0: int, r1: int, kend: int, shift: int, src, labels, offset: int, docs=None):
    """cand (rows, kend) (documents: (B, 1, rows, kend)) and match (B, 1, rows, kend) or None, as
    the dense path's masks."""
    cand = candidate_mask(query_positions(offset + r0, r1 - r0, src.device), kend, shift, docs)
    match = None
    if labels is not None:
        match = (cand & (src[:, None, :kend] == labels[:, r0:r1, None])).unsqueeze(1)
    return per_head(cand), match


def _softmax_weights(scores: torch.Tensor, mask: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) on the mask, 0 elsewhere and on rows whose lse is -inf."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1)
    return torch.exp(scores.masked_fill(~mask, NEG_INF) - safe)


def _row_grad(grad: torch.Tensor, lse: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """The incoming gradient of rows r0..r1-1, zero where the row is empty (lse = -inf): such a
    row passes nothing back, whatever arrives (an inf there would otherwise make 0 * inf = nan)."""
    g, rows = grad[:, :, r0:r1], lse[:, :, r0:r1]
    return torch.where(torch.isfinite(rows), g, torch.zeros_like(g)).unsqueeze(-1)


class _ChunkedCopyLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, src, labels, shift: int, chunk: int, offset: int, docs):
        B, H, T, d = q.shape
        scale = 1.0 / math.sqrt(d)
        a = q.new_full((B, H, T), NEG_INF)
        m = q.new_full((B, H, T), NEG_INF) if labels is not None else None
        for r0, r1, kend in _blocks(T, k.shape[2], chunk, shift, offset):
            if kend == 0:
                continue  # no row of this block has a candidate
            scores = (q[:, :, r0:r1] @ k[:, :, :kend].transpose(-1, -2)) * scale  # (B, H, rows, kend)
            cand, match = _block_masks(r0, r1, kend, shift, src, labels, offset, docs)
            a[:, :, r0:r1] = masked_logsumexp(scores, cand, dim=-1)
            if m is not None:
                m[:, :, r0:r1] = masked_logsumexp(scores, match, dim=-1)
        ctx.shift, ctx.chunk, ctx.offset = shift, chunk, offset
        ctx.save_for_backward(q, k, src, labels, a, m, docs)  # labels, m: None without labels; docs: without documents
        if m is None:
            return a
        return a, m

    @staticmethod
    def backward(ctx, grad_a, grad_m=None):
        q, k, src, labels, a, m, docs = ctx.saved_tensors
        B, H, T, d = q.shape
        scale = 1.0 / math.sqrt(d)
        dq, dk = torch.zeros_like(q), torch.zeros_like(k)
        for r0, r1, kend in _blocks(T, k.shape[2], ctx.chunk, ctx.shift, ctx.offset):
            if kend == 0:
                continue
            qb, kb = q[:, :, r0:r1], k[:, :, :kend]
            scores = (qb @ kb.transpose(-1, -2)) * scale
            cand, match = _block_masks(r0, r1, kend, ctx.shift, src, labels, ctx.offset, docs)
            ds = _row_grad(grad_a, a, r0, r1) * _softmax_weights(scores, cand, a[:, :, r0:r1])
            if labels is not None and grad_m is not None:
                ds = ds + _row_grad(grad_m, m, r0, r1) * _softmax_weights(scores, match, m[:, :, r0:r1])
            ds = ds * scale
            dq[:, :, r0:r1] = ds @ kb
            dk[:, :, :kend] += ds.transpose(-1, -2) @ qb
        return dq, dk, None, None, None, None, None, None


def chunked_copy_lse(q: torch.Tensor, k: torch.Tensor, src: torch.Tensor, labels: torch.Tensor | None,
                     shift: int, chunk: int, offset: int = 0, docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-head (A, M), each (B, H, Tq), from q (B, H, Tq, d) of positions offset.. and k
    (B, H, Tk, d) of positions 0.., float32, src (B, Tk) pasted ids (-1: none), labels (B, Tq) or
    None (then M is None); shift -1 (`next`) or 0 (`self`); docs (B, Tk) document indices or None."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    out = _ChunkedCopyLSE.apply(q, k, src, labels, shift, chunk, offset, docs)
    if labels is None:
        return out, None
    return out


# --- flex: one fused kernel (CUDA) -------------------------------------------------------------

FLEX_VALUE_DIM = 16  # width of the all-zero values: the kernel's attention output is never read
FLEX_BLOCK = 128  # FlexAttention's default block; copy.impl=auto takes flex for lengths in whole blocks


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once per process (static shapes: training's do not change)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_call(q, k, v, block_mask, compiled: bool, **kwargs):
    """FlexAttention under `block_mask`: the kernel compiled once per process, or its unfused
    eager reference (which announces itself on every call: silenced here). The copy LSE's and
    document-masked attention's one way in."""
    from torch.nn.attention.flex_attention import flex_attention

    attend = _compiled_flex_attention() if compiled else flex_attention
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return attend(q, k, v, block_mask=block_mask, **kwargs)


@functools.lru_cache(maxsize=16)
def candidate_block_mask(Tq: int, Tk: int, limit: int, device: torch.device):
    """(FlexAttention BlockMask of C_t for queries t = 0.. against keys j <= t + limit, its
    visible blocks all marked partial as (kv_num_blocks, kv_indices)). The first lets the kernel
    skip the mask inside fully visible blocks (A_t); the match mask (M_t) reuses the second, in
    which the kernel evaluates its mask_mod in every block. Built once per shape."""
    from torch.nn.attention.flex_attention import create_block_mask

    def candidates(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + limit

    full = create_block_mask(candidates, None, None, Tq, Tk, device=device)
    return full, visible_blocks(full)


def visible_blocks(full) -> tuple[torch.Tensor, torch.Tensor]:
    """A BlockMask's visible blocks, partial or full, all as partial: (kv_num_blocks, kv_indices)."""
    visible = full.to_dense()  # (B or 1, 1, q blocks, kv blocks): 1 where a block holds a candidate
    num = visible.sum(-1).to(torch.int32)
    order = torch.argsort(visible, dim=-1, descending=True, stable=True).to(torch.int32)  # visible first, in order
    return num, order


def document_candidates(Tq: int, Tk: int, limit: int, offset: int, docs: torch.Tensor):
    """The BlockMask of keys j <= t + limit in t's document, for queries t = offset + q_idx (per
    row of the batch, built per call: the documents change every batch). limit = offset + shift:
    the copy head's C_t; limit = offset: document-masked attention (cplm_dist.model.documents)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def candidates(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + limit) & (docs[b, kv_idx] == docs[b, q_idx + offset])

    return create_block_mask(candidates, docs.shape[0], None, Tq, Tk, device=docs.device)


def document_block_mask(Tq: int, Tk: int, limit: int, offset: int, docs: torch.Tensor):
    """candidate_block_mask's pair under document masking: `document_candidates` and its visible blocks."""
    full = document_candidates(Tq, Tk, limit, offset, docs)
    return full, visible_blocks(full)


def match_block_mask(Tq: int, Tk: int, limit: int, device: torch.device, mask_mod, blocks=None):
    """The BlockMask for M_t: C_t's visible blocks, every one partial, with `mask_mod` inside;
    `blocks`: document_block_mask's pair under document masking (default: candidate_block_mask's)."""
    from torch.nn.attention.flex_attention import BlockMask

    full, (num, order) = blocks if blocks is not None else candidate_block_mask(Tq, Tk, limit, device)
    return BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=full.BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=full.seq_lengths)


def flex_copy_lse(q: torch.Tensor, k: torch.Tensor, src: torch.Tensor, labels: torch.Tensor | None,
                  shift: int, offset: int = 0, compiled: bool | None = None,
                  docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-head (A, M), as `chunked_copy_lse`'s arguments, from FlexAttention's LSE (module
    docstring); compiled: the fused kernel (default on CUDA) or FlexAttention's unfused eager
    reference (default elsewhere; forward only on CPU)."""
    if compiled is None:
        compiled = q.device.type == "cuda"
    B, H, Tq, _ = q.shape
    limit = offset + shift
    blocks = (candidate_block_mask(Tq, k.shape[2], limit, q.device) if docs is None
              else document_block_mask(Tq, k.shape[2], limit, offset, docs))
    full = blocks[0]
    values = q.new_zeros(B, H, k.shape[2], FLEX_VALUE_DIM)

    def lse(block_mask):
        return flex_attention_call(q, k, values, block_mask, compiled, **_lse_request())[1]

    a = _lse_tensor(lse(full))
    if labels is None:
        return a, None

    def pasted_label(b, h, q_idx, kv_idx):  # j in C_t and j pastes y_t
        return (kv_idx <= q_idx + limit) & (src[b, kv_idx] == labels[b, q_idx])

    def pasted_label_in_document(b, h, q_idx, kv_idx):  # and j is in t's document
        return pasted_label(b, h, q_idx, kv_idx) & (docs[b, kv_idx] == docs[b, q_idx + offset])

    mask_mod = pasted_label if docs is None else pasted_label_in_document
    return a, _lse_tensor(lse(match_block_mask(Tq, k.shape[2], limit, q.device, mask_mod, blocks)))


@functools.cache
def _lse_request() -> dict:
    """The keyword asking FlexAttention for its LSE: return_aux (torch >= 2.9), else return_lse."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def _lse_tensor(aux) -> torch.Tensor:
    return aux if isinstance(aux, torch.Tensor) else aux.lse
