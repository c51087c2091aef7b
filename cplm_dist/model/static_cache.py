"""The static decode cache, the one decode state: every tensor decoding and scoring keep,
preallocated for the prompt plus the new tokens and written in place (no per-step concatenation,
so one decode step has static shapes and compiles once: cplm_dist.model.static_decode).

    cache = model.new_decode_state(batch=B, slots=S)   # or StaticCache.allocate(model, B, S, device, dtype)
    cache.layers[i].k, .v   (B, nkv/tp, S, hd)   each layer's keys and values
    cache.copy_k            (B, H_c, S, d_c)     the copy head's keys (float32), None without a copy head
    cache.ids               (B, S)               the id at each slot
    cache.positions         (B, S)               its position (RoPE, learned positions)
    cache.docs              (B, S)               its document index; PAD_DOC on a row's padding
    slots = cache.reserve(ids, position_ids)     # a chunk's positions and documents, after what it holds

Slots are the cache's columns, positions what the model reads. Batches of unequal prompts are
LEFT-padded: row b's prompt of L_b tokens fills slots P - L_b .. P - 1 (P the longest), so every
row writes its next token at the same slot and the step stays one static shape. Padding slots
carry the document index PAD_DOC, which no real token has, so one rule hides them from attention
and from the copy head's candidates alike, the rule document masking already is: a query at slot
i sees slot j iff j <= i and both hold the same document (cplm_dist.model.copy_lse.candidate_mask).
Each row's positions start at 0 at its first real token, so a padded row computes what it
computes alone. `causal`: every row one document from slot 0, nothing padded, so attention's
kernel needs no mask of its own.

`cursor` tells the layers' caches where the forward in flight writes (`slots`, a tensor: the
compiled step takes a new slot without recompiling) and how many leading slots its kernel reads
(`keys`: the written prefix; None: all S, the decode step's static shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cplm_dist.model.documents import check_positions, continued_positions, document_index

PAD_DOC = -1  # the document index of padding slots: attended by nothing real, pasted from never


@dataclass
class Cursor:
    slots: torch.Tensor  # (T,) long: the slots the forward in flight writes
    keys: int | None = None  # the leading slots attention reads; None: every slot


@dataclass
class StaticKV:
    """One layer's keys and values (B, nkv, S, hd), written at the cursor's slots."""

    k: torch.Tensor
    v: torch.Tensor
    cursor: Cursor

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hd) at the cursor's slots; the keys and values attention reads."""
        at = self.cursor.slots
        self.k[:, :, at] = k.to(self.k.dtype)
        self.v[:, :, at] = v.to(self.v.dtype)
        n = self.cursor.keys
        return (self.k, self.v) if n is None else (self.k[:, :, :n], self.v[:, :, :n])


@dataclass
class StaticCache:
    layers: list[StaticKV]
    cursor: Cursor
    ids: torch.Tensor
    positions: torch.Tensor
    docs: torch.Tensor
    copy_k: torch.Tensor | None
    step_slot: torch.Tensor  # (1,) long: the slot a decode step writes, filled in place each step
    length: int = 0  # slots written
    causal: bool = True  # one document a row from slot 0, no padding: the kernel's causal masks serve

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def slots(self) -> int:
        return self.ids.shape[1]

    @classmethod
    def allocate(cls, model, batch: int, slots: int, device: torch.device, dtype: torch.dtype) -> "StaticCache":
        """The buffers of `model` (a CPLM) for `batch` rows of `slots` slots."""
        attention = model.layers[0].attention
        shape = (batch, attention.kv_heads, slots, attention.head_dim)
        cursor = Cursor(torch.zeros(1, dtype=torch.long, device=device))
        layers = [StaticKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                           cursor) for _ in model.layers]
        head = model.copy_head
        copy_k = None if head is None else torch.zeros(batch, head.heads, slots, head.head_dim, device=device)
        new = lambda fill: torch.full((batch, slots), fill, dtype=torch.long, device=device)  # noqa: E731
        cache = cls(layers, cursor, new(0), new(0), new(PAD_DOC), copy_k, torch.zeros(1, dtype=torch.long, device=device))
        if device.type == "cuda":  # CUDA graphs replay on these addresses (their contents change in place)
            for t in cache.buffers():
                torch._dynamo.mark_static_address(t)
        return cache

    def buffers(self) -> list[torch.Tensor]:
        kv = [t for layer in self.layers for t in (layer.k, layer.v)]
        return kv + [self.ids, self.positions, self.docs, self.step_slot] + ([self.copy_k] if self.copy_k is not None else [])

    def reset(self) -> None:
        """Empty for the next request (the keys need no clearing: unwritten slots are never read)."""
        self.docs.fill_(PAD_DOC)
        self.length, self.causal = 0, True

    def reserve(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The next T slots for ids (B, T): their positions (given: document masking's, which may
        start new documents; None: continuing the last document, from 0 when empty) and document
        indices written, the slots (T,) returned; the ids themselves are written by the forward
        that runs them (CPLM.over_cache)."""
        T, t0 = ids.shape[1], self.length
        if t0 + T > self.slots:
            raise ValueError(f"{t0 + T} positions do not fit a decode state of {self.slots}")
        device = self.ids.device
        if position_ids is not None:
            check_positions(position_ids, ids, full_row=False)
            self.causal = False
        elif t0 == 0:
            position_ids = torch.arange(T, device=device).expand(ids.shape[0], T)
        else:
            position_ids = continued_positions(self.positions[:, t0 - 1:t0], T)
        slots = torch.arange(t0, t0 + T, device=device)
        self.positions[:, slots] = position_ids
        self.docs[:, slots] = document_index(self.positions[:, slots], self.docs[:, :t0])
        self.length = t0 + T
        return slots

    def select(self, rows: torch.Tensor) -> "StaticCache":
        """A cache whose row i continues this one's row rows[i] (a shared prompt fanned out to
        several continuations, as the lm-eval adapter scores the options of one question)."""
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        cursor = Cursor(self.cursor.slots.clone(), self.cursor.keys)
        layers = [StaticKV(pick(layer.k), pick(layer.v), cursor) for layer in self.layers]
        return StaticCache(layers, cursor, pick(self.ids), pick(self.positions), pick(self.docs), pick(self.copy_k),
                           self.step_slot.clone(), self.length, self.causal)

    def fits(self, batch: int, slots: int) -> bool:
        return self.batch == batch and self.slots == slots


def bucket(needed: int, limit: int, smallest: int = 128) -> int:
    """The cache length for `needed` slots: the next power of two from `smallest`, at most `limit`
    (model.max_seq_len plus a prompt's padding): each bucket is one compiled shape, paid once."""
    size = smallest
    while size < needed:
        size *= 2
    return max(needed, min(size, limit))
