"""Greedy and sampled generation from the mixed next-token distribution, with a KV cache.

    out = generate(model, prompt_ids, max_new_tokens=32, temperature=0.8, top_p=0.95, mark_copies=True)
    out.tokens (B, n), out.copied (B, n): True where the copy head gave the chosen token most of its mass

`model` is a CPLM, decoded by its static-cache decoder (cplm_dist.model.static_decode: the cache
preallocated, one compiled step a token, the greedy token from shard maxima without gathering the
vocabulary; when sampling, every tp rank gets the gathered distribution and, sharing the seed,
samples the same token), or anything with `next_token_logprobs(ids) -> (B, T, V)` (re-run on the
whole prefix each step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cplm_dist.model.next_token import copied_mostly


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, n) new tokens; after an end-of-document, more of it
    copied: torch.Tensor | None  # (B, n) bool, or None when not asked / no copy head


def device_of(model) -> torch.device:
    """Where a model's parameters live (the CPU for a model without any): every tensor an
    evaluation or generation path makes for it goes there."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return param.device if param is not None else torch.device("cpu")


def choose(logprobs: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens (B,) from log-probabilities (B, V): greedy at temperature 0, else sampled
    after temperature, top-k and nucleus (top-p) filtering."""
    if temperature <= 0:
        return logprobs.argmax(dim=-1)
    scores = logprobs.float() / temperature
    if not torch.isfinite(scores.amax(dim=-1)).all():  # a temperature so small that the scores overflow
        return logprobs.argmax(dim=-1)
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_scores, dim=-1) >= top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False  # the most likely token always stays (top_p -> 0 is greedy, never an empty set)
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logprobs.device)


def prompt_rows(prompt) -> list[torch.Tensor]:
    """The prompts of a batch, one 1-D tensor each: rows of a (B, T) tensor, or a list of
    sequences of any lengths (a batch of unequal prompts)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 2:
            raise ValueError(f"prompt of shape {tuple(prompt.shape)}: give (B, T) ids or a list of 1-D prompts")
        return list(prompt.unbind(0))
    return [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompt]


@torch.no_grad()
def generate(model, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | None = None, seed: int = 0, mark_copies: bool = False,
             generator: torch.Generator | None = None, prefill_chunk: int | None = None,
             position_ids=None, compile: bool | None = None) -> Generation:
    """prompt: (B, T) ids, or a list of B prompts of any lengths (each row then decodes as it
    would alone: cplm_dist.model.static_cache pads them on the left). generator: a CPU generator
    that goes on across calls (repeated sampled requests then differ); default: a fresh one seeded
    with `seed`. prefill_chunk: feed a long prompt this many tokens at a time into the cache, so
    that no chunk's activations are the whole prompt's. position_ids: per prompt (as the prompt is
    given), document masking's positions. compile: the compiled decode step (None: where
    torch.compile works, unless CPLM_DECODE_COMPILE=0; cplm_dist.model.static_decode)."""
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    rows = prompt_rows(prompt)
    device = device_of(model)
    if not hasattr(model, "new_decode_state"):
        return _generate_uncached(model, rows, max_new_tokens, temperature, top_k, top_p, eos_id, gen)
    from cplm_dist.model.static_decode import decoder_for

    decoder = decoder_for(model, compile)
    greedy_mode = temperature <= 0
    positions = None if position_ids is None else prompt_rows(position_ids)
    out = decoder.prefill(rows, max_new_tokens, positions, prefill_chunk, greedy_mode=greedy_mode, mark_copies=mark_copies)
    tokens, copied = [], []
    done = torch.zeros(len(rows), dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        if greedy_mode:
            nxt, mark = out
        else:
            logprobs, copy_part = out
            nxt = choose(logprobs, temperature, top_k, top_p, gen)
            at = lambda t: t.gather(-1, nxt[:, None]).squeeze(-1)  # noqa: E731
            mark = None if copy_part is None else copied_mostly(at(copy_part), at(logprobs))
        nxt = end_of_document(nxt, done, eos_id)
        tokens.append(nxt)
        if mark_copies and mark is not None:
            copied.append(mark)
        if i + 1 == max_new_tokens or (eos_id is not None and bool(done.all())):
            break
        out = decoder.step(nxt, greedy_mode=greedy_mode, mark_copies=mark_copies)
    return Generation(torch.stack(tokens, dim=1), torch.stack(copied, dim=1) if copied else None)


def end_of_document(nxt: torch.Tensor, done: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """The next tokens (B,) after an end-of-document: a row that ended goes on with it; `done`
    (B,) marks the rows that have ended (updated in place)."""
    if eos_id is None:
        return nxt
    nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
    done |= nxt == eos_id
    return nxt


def _generate_uncached(model, rows: list[torch.Tensor], max_new_tokens: int, temperature: float, top_k: int,
                       top_p: float, eos_id: int | None, gen: torch.Generator) -> Generation:
    """A model with only `next_token_logprobs(ids) -> (B, T, V)` (the reference models in tests):
    the whole prefix again each step; prompts of one length."""
    if len({r.numel() for r in rows}) > 1:
        raise ValueError("prompts of unequal lengths need a model that decodes with a cache (a CPLM)")
    ids = torch.stack(rows)
    tokens = []
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        nxt = end_of_document(choose(model.next_token_logprobs(ids)[:, -1], temperature, top_k, top_p, gen), done, eos_id)
        tokens.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    return Generation(torch.stack(tokens, dim=1), None)
