"""Decoding a CPLM with a static cache and a compiled step: what `generate` runs
(cplm_dist.evaluation.generation), and through it tools/generate.py, tools/evaluate.py, the
long-context suite and the lm-eval adapter's generate requests.

    decoder = decoder_for(model)                        # one a model, kept: its compiled step and cache
    first = decoder.prefill(rows, new_tokens)           # rows: B prompts, any lengths (left-padded inside)
    out = decoder.step(token)                           # one token a row, one compiled region

A step is one forward of one token for the whole model, the head included: the embedding, every
layer (its keys and values written at the step's slot of the StaticCache, attention over all S
slots under the slot mask), the final norm, the LM head's shard, the copy head's query and key,
its weights over the slots, and then either the greedy token from shard maxima
(cplm_dist.model.next_token.greedy: the vocabulary never gathered) or, when sampling, the mixed
distribution built once (`full_log_probs`). Its shapes are static (B, S fixed by the bucket, the
slot a tensor), so torch.compile traces it once per (batch, bucket, greedy, mark) and every later
call reuses the graph; on CUDA the graph runs as a CUDA graph (mode="reduce-overhead"). The
prefill runs eager: it is a few large matmuls, which compilation does not speed up, and a
compiled prefill would be one more shape for every prompt length.

Compilation is on where torch.compile can build kernels (cplm_dist.model.compiled) unless
`compile=False` or CPLM_DECODE_COMPILE=0; a step that dynamo or inductor fails to compile warns
once and the decoder goes on eager (`path` says which ran; any other error, an OOM among them,
propagates). Dynamo's settings the step needs hold around its calls only. A model moved or cast
after decoding gets a new cache and graphs on its next request; `release(model)` frees them.
Tensor parallelism: every rank runs the same step, the collectives inside it (the row-parallel
linears' all-reduces, LSE and the argmax's maxima).

The prefill and the step run the model's own trunk and head over the cache (CPLM.over_cache,
CPLM.head_over), as scoring does; this module adds the left padding, the step's static shapes
and its compilation.
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import torch

from cplm_dist.model.compiled import unavailable_reason
from cplm_dist.model.copy_lse import candidate_mask
from cplm_dist.model.core_attention import Masks
from cplm_dist.model.documents import check_positions, document_index
from cplm_dist.model.next_token import full_log_probs, greedy
from cplm_dist.model.static_cache import StaticCache, bucket

log = logging.getLogger(__name__)

ENV = "CPLM_DECODE_COMPILE"
RECOMPILE_LIMIT = 64


def compile_default(device: torch.device) -> bool:
    """Whether decoding compiles by default here: yes where torch.compile can build kernels for
    `device`, unless CPLM_DECODE_COMPILE=0."""
    return os.environ.get(ENV, "1") not in ("0", "false", "no") and unavailable_reason(device) is None


def decoder_for(model, compile: bool | None = None) -> "StaticDecoder":
    """The model's decoder (made once and kept on it, so its compiled steps are paid once), set to
    compile or not (None: `compile_default`), following the model's device and dtype."""
    decoder = model.__dict__.get("_static_decoder")
    if decoder is None:
        decoder = StaticDecoder(model)
        model.__dict__["_static_decoder"] = decoder  # not a submodule: no state-dict entries
    decoder.follow()
    decoder.compile = compile_default(decoder.device) if compile is None else compile
    return decoder


def release(model) -> None:
    """Free the model's decode cache and compiled graphs (the next request builds them anew)."""
    decoder = model.__dict__.pop("_static_decoder", None)
    if decoder is not None:
        decoder.release()


def compiler_error(e: BaseException) -> bool:
    """Whether `e` is dynamo's or inductor's failure to compile (not an OOM inside them)."""
    if isinstance(e, torch.OutOfMemoryError) or isinstance(e.__cause__, torch.OutOfMemoryError):
        return False
    return isinstance(e, torch._dynamo.exc.TorchDynamoException) or type(e).__module__ == "torch._inductor.exc"


class StaticDecoder:
    def __init__(self, model):
        if getattr(model, "context", None) is not None or getattr(model, "sequence_parallel", False):
            raise RuntimeError("a context- or sequence-parallel model trains only: load its checkpoint with "
                               "cplm_dist.checkpoint.load_model (built without them) to decode")
        self.model = model
        self.device = self.dtype = None
        self.compile = False
        self.path: str | None = None  # what the last step ran: "compiled" or "eager"
        self.release()
        self.follow()

    def release(self) -> None:
        """Drop the cache and the compiled step (and what is known of its shapes)."""
        self.cache: StaticCache | None = None
        self.compiled = None  # torch.compile of `_decode`, made on the first compiled step
        self.compile_seconds: dict[tuple, float] = {}  # per compiled shape: its first call's seconds
        self._failed = False

    def follow(self) -> None:
        """Take the model's device and dtype now; where either changed, the cache and graphs go."""
        param = next(self.model.parameters())
        if (param.device, param.dtype) != (self.device, self.dtype):
            self.release()
            self.device, self.dtype = param.device, param.dtype

    # --- the cache -------------------------------------------------------------------------------

    def _allocate(self, batch: int, slots: int) -> StaticCache:
        if self.cache is None or not self.cache.fits(batch, slots):
            self.cache = None  # the old buffers go before the new ones come
            self.cache = self.model.new_decode_state(batch, slots)
        self.cache.reset()
        return self.cache

    # --- prefill (eager) ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, rows: list[torch.Tensor], new_tokens: int, position_ids: list[torch.Tensor] | None = None,
                chunk: int | None = None, *, greedy_mode: bool = True, mark_copies: bool = False):
        """Write the prompts `rows` (1-D each, lengths may differ; left-padded) into a fresh cache
        with room for `new_tokens` more, `chunk` prompt slots a forward (None: all at once); the
        head's output at each row's last prompt token (as `step` returns it)."""
        lengths = [int(r.numel()) for r in rows]
        if min(lengths) < 1:
            raise ValueError("every prompt needs at least one token")
        limit = self.model.model_cfg.max_seq_len
        if max(lengths) + new_tokens > limit:
            raise ValueError(f"sequence length {max(lengths) + new_tokens} exceeds model.max_seq_len={limit}")
        P = max(lengths)
        c = self._allocate(len(rows), bucket(P + new_tokens, limit + P - min(lengths)))
        ids = torch.zeros(len(rows), P, dtype=torch.long, device=self.device)  # left-padded; the forwards write them
        for b, (row, n) in enumerate(zip(rows, lengths)):
            pos = torch.arange(n, device=self.device) if position_ids is None else position_ids[b].to(self.device)
            if position_ids is not None:
                check_positions(pos[None], row[None], full_row=False)
            ids[b, P - n:P] = row.to(self.device)
            c.positions[b, P - n:P] = pos
            c.docs[b, P - n:P] = document_index(pos[None])[0]
        chunk = chunk or P
        if chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
        # causal: the kernel's own masks (flash on CUDA); padded or packed: SDPA's dense block-causal mask
        c.causal = position_ids is None and min(lengths) == P
        m = self.model
        for t0 in range(0, P, chunk):
            t1 = min(P, t0 + chunk)
            slots = torch.arange(t0, t1, device=self.device)
            h, q = m.over_cache(ids[:, t0:t1], c, slots, t1, m.cache_masks(c, t0, t1))
        c.length = P
        last = torch.full((1,), P - 1, dtype=torch.long, device=self.device)
        return self._head(h[:, -1:], None if q is None else q[:, :, -1:], last, P, greedy_mode, mark_copies)

    # --- one step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, token: torch.Tensor, *, greedy_mode: bool = True, mark_copies: bool = False):
        """Feed `token` (B,) at the next slot: (next token (B,), copied (B,) or None) when greedy,
        else (log p (B, V), the copy part or None), the same on every tp rank."""
        c = self.cache
        if c is None or c.length < 1:
            raise RuntimeError("decode step with no cached position: prefill a prompt first")
        if c.length >= c.slots:
            raise RuntimeError("decode step past the cache: prefill first, with room for the new tokens")
        c.step_slot.fill_(c.length)
        c.cursor.slots, c.cursor.keys = c.step_slot, None
        out = self._run(token, greedy_mode, mark_copies)
        c.length += 1
        return out

    def _run(self, token: torch.Tensor, greedy_mode: bool, mark_copies: bool):
        c = self.cache
        if not self.compile or self._failed:
            self.path = "eager"
            return self._decode(token, c.step_slot, greedy_mode, mark_copies)
        if self.compiled is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self.compiled = torch.compile(self._decode, dynamic=False, mode=mode, fullgraph=True)
        key = (c.batch, c.slots, greedy_mode, mark_copies)
        start = time.perf_counter()
        try:
            with _dynamo_settings():
                out = self.compiled(token, c.step_slot, greedy_mode, mark_copies)
        except Exception as e:
            if not compiler_error(e):
                raise
            log.warning("the compiled decode step failed (%s: %s): decoding eager", type(e).__name__,
                        (str(e).splitlines() or [""])[0][:200])
            self._failed = True
            return self._run(token, greedy_mode, mark_copies)
        if key not in self.compile_seconds:
            self.compile_seconds[key] = time.perf_counter() - start
        self.path = "compiled"
        return tuple(None if t is None else t.clone() for t in out)  # CUDA graphs reuse their outputs

    def _decode(self, token: torch.Tensor, slot: torch.Tensor, greedy_mode: bool, mark_copies: bool):
        """The compiled region: `token` (B,) at slot `slot` (1,) through the whole model and head."""
        c, m = self.cache, self.model
        previous = slot - 1
        c.positions[:, slot] = c.positions[:, previous] + 1
        c.docs[:, slot] = c.docs[:, previous]
        masks = Masks(dense=candidate_mask(slot, c.slots, 0, c.docs).unsqueeze(1))  # (B, 1, 1, S)
        h, q = m.over_cache(token[:, None], c, slot, None, masks)
        return self._head(h, q, slot, None, greedy_mode, mark_copies)

    def _head(self, h: torch.Tensor, q: torch.Tensor | None, slot: torch.Tensor, keys: int | None,
              greedy_mode: bool, mark_copies: bool):
        """The next token's head output for the last states h (B, 1, D) and queries q at `slot`,
        over the first `keys` slots (None: all)."""
        m = self.model
        logits, copy = m.head_over(h, q, self.cache, slot, keys)
        if greedy_mode:
            return greedy(logits, copy, m.copy_cfg.mix, m.tp_group, mark_copies)
        out = full_log_probs(logits, copy, m.copy_cfg.mix, m.vocab_size, m.tp_group, mark_copies)
        return tuple(None if t is None else t[:, 0] for t in out)

def _dynamo_settings():
    """What the compiled step needs of dynamo, for its calls only: megatron-core's row-parallel
    linear warns (a deprecation) on every call, ignored in the graph rather than a break in it;
    one graph per (batch, bucket, greedy, marks), and an evaluation meets more than dynamo's
    default 8, past which it would run the step eager without a word."""
    config = torch._dynamo.config
    return config.patch(ignore_logging_functions=config.ignore_logging_functions | {warnings.warn},
                        recompile_limit=max(config.recompile_limit, RECOMPILE_LIMIT))
