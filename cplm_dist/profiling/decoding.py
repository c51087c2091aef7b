"""Decoding speed with the KV cache, copy head on against off: the inference overhead of a CPLM.

Each point (batch, prompt length) prefills a random prompt, then decodes `new_tokens` greedy
tokens one at a time through `CPLM.decode` (the path `tools/generate.py` takes); the copy-on and
copy-off models alternate over `rounds` and each keeps its median. Decoding a token with the copy
head adds its query and key projections, one score row over the cached copy keys and the
scatter of the copy mass onto the vocabulary.
"""

from __future__ import annotations

import statistics
import time

import torch

from cplm_dist.distributed import synchronize


@torch.no_grad()
def decode_once(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for `new_tokens` tokens) of one greedy generation."""
    device = prompt.device
    state = model.new_decode_state()
    synchronize(device)
    start = time.perf_counter()
    logprobs, _ = model.decode(prompt, state, last_only=True)
    nxt = logprobs[:, -1].argmax(dim=-1)
    synchronize(device)
    prefilled = time.perf_counter()
    for _ in range(new_tokens):
        logprobs, _ = model.decode(nxt[:, None], state, last_only=True)
        nxt = logprobs[:, -1].argmax(dim=-1)
    synchronize(device)
    return prefilled - start, time.perf_counter() - prefilled


def decode_overhead(models: dict, vocab_size: int, points: list[tuple[int, int]], new_tokens: int, rounds: int,
                    device: torch.device, seed: int = 0) -> list[dict]:
    """One row per (batch, prompt): each model's prefill time and decode tokens/s (medians over
    `rounds`, the models alternating), and the copy-on / copy-off time ratios."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch, prompt_len in points:
        prompt = torch.randint(0, vocab_size, (batch, prompt_len), generator=gen).to(device)
        for model in models.values():  # warm-up: allocator, kernels, caches
            decode_once(model, prompt[:, : min(prompt_len, 16)], 2)
        times = {name: [] for name in models}
        for _ in range(rounds):
            for name, model in models.items():
                times[name].append(decode_once(model, prompt, new_tokens))
        row = {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens}
        for name, pairs in times.items():
            prefill = statistics.median(p for p, _ in pairs)
            decode = statistics.median(d for _, d in pairs)
            row.update({f"{name}_prefill_s": prefill, f"{name}_decode_tokens_per_s": batch * new_tokens / decode,
                        f"{name}_ms_per_token": 1e3 * decode / new_tokens})
        if {"copy_on", "copy_off"} <= set(models):
            row["decode_time_ratio"] = row["copy_on_ms_per_token"] / row["copy_off_ms_per_token"]
            row["prefill_time_ratio"] = row["copy_on_prefill_s"] / row["copy_off_prefill_s"]
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| batch | prompt | new | copy off tokens/s | copy on tokens/s | decode on/off | prefill on/off |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prompt']} | {r['new_tokens']} | {r['copy_off_decode_tokens_per_s']:,.0f} | "
                     f"{r['copy_on_decode_tokens_per_s']:,.0f} | {r['decode_time_ratio']:.3f} | {r['prefill_time_ratio']:.3f} |")
    return "\n".join(lines)
