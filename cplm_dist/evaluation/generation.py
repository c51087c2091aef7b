"""Greedy and sampled generation from the mixed next-token distribution, with a KV cache.

    out = generate(model, prompt_ids, max_new_tokens=32, temperature=0.8, top_p=0.95, mark_copies=True)
    out.tokens (B, n), out.copied (B, n): True where the copy head gave the chosen token most of its mass

`model` is a CPLM (its `decode` keeps keys and values between steps, on any tp: every rank gets
the gathered distribution and, sharing the seed, samples the same token) or anything with
`next_token_logprobs(ids) -> (B, T, V)` (re-run on the whole prefix each step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | None = None, seed: int = 0, mark_copies: bool = False,
             generator: torch.Generator | None = None, prefill_chunk: int | None = None) -> Generation:
    """generator: a CPU generator that goes on across calls (repeated sampled requests then differ);
    default: a fresh one seeded with `seed`. prefill_chunk: feed a long prompt this many tokens at
    a time into the cache (`prefill`), so that no chunk's activations are the whole prompt's."""
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    cached = hasattr(model, "decode")
    state = model.new_decode_state() if cached else None
    ids, feed = prompt, prompt
    if cached and prefill_chunk:
        feed = prefill(model, prompt, state, prefill_chunk)
    tokens, copied = [], []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        if cached:
            logprobs, copy_part = model.decode(feed, state, with_copy_part=mark_copies, last_only=True)
            logprobs = logprobs[:, -1]
            copy_part = copy_part[:, -1] if copy_part is not None else None
        else:
            logprobs, copy_part = model.next_token_logprobs(ids)[:, -1], None
        nxt = choose(logprobs, temperature, top_k, top_p, gen)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        tokens.append(nxt)
        if copy_part is not None:
            chosen = lambda t: t.gather(-1, nxt[:, None]).squeeze(-1)  # noqa: E731
            copied.append(chosen(copy_part) - chosen(logprobs) > math.log(0.5))
        feed = nxt[:, None]
        ids = torch.cat([ids, feed], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    return Generation(torch.stack(tokens, dim=1), torch.stack(copied, dim=1) if copied else None)


@torch.no_grad()
def prefill(model, prompt: torch.Tensor, state, chunk: int) -> torch.Tensor:
    """Feed all but the last `chunk`-or-fewer tokens of `prompt` into the decode `state`, `chunk`
    at a time, reading nothing (decode's last_only keeps a chunk at (B, 1, V)); returns the rest,
    whose feed gives the first new token's distribution."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    cut = ((prompt.shape[1] - 1) // chunk) * chunk
    for t in range(0, cut, chunk):
        model.decode(prompt[:, t:t + chunk], state, last_only=True)
    return prompt[:, cut:]
