"""Decoding speed through `generate` (the door every tool decodes through): copy head on against
off, compiled against eager, and against transformers' `generate()` on the same weights.

Each point (batch, prompt length) times greedy generations of a random prompt, every model
alternating over `rounds` (their order reversed every other round): a generation of one token and,
right after it, one of `new_tokens`; the prefill is the single token's time and a decoded token
costs the median over rounds of
    (t(new_tokens) - t(1)) / (new_tokens - 1),
the same arithmetic for ours and for transformers, so their per-token figures compare the decode
loops alone; a whole call (`*_call_s`, the median generation of `new_tokens`, the prefill
included) is reported beside it, and `call_speedup_vs_peer` from it. The peer (`peer_model`) is
what a user loads: transformers' `from_pretrained` of the copy-off model's export (the backbone's
stock class, LlamaForCausalLM for llama), decoding with its own cache; the tokens of both are
compared. Compile time: what the first generation of a shape costs above a
later one (cplm_dist.model.static_decode: once per batch and cache bucket).
"""

from __future__ import annotations

import statistics
import time

import torch

from cplm_dist.distributed import synchronize


def peer_model(model, cfg, device: torch.device):
    """What a user loads: transformers' `from_pretrained` of `model`'s export (a copy-off CPLM at
    tp = 1, written as tools/export_hf.py writes it, in its dtype: the backbone's stock class, its
    attention transformers' default), in eval mode on `device`."""
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from cplm_dist.interop.hf.directory import write_hf_dir
    from cplm_dist.model.parallel.sharding import full_state_dict

    dtype = next(model.parameters()).dtype
    with tempfile.TemporaryDirectory(prefix="cplm-peer-") as directory:
        write_hf_dir(full_state_dict([model.state_dict()], model), cfg.model, cfg.copy, Path(directory), dtype)
        hf = AutoModelForCausalLM.from_pretrained(directory)
        for p in hf.parameters():  # in memory of its own, not a view of the file going away
            p.data = p.data.clone()
    return hf.to(device).eval()


class Ours:
    """generate() of a CPLM, compiled or eager."""

    def __init__(self, model, compile: bool):
        self.model, self.compile = model, compile

    def __call__(self, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        from cplm_dist.evaluation.generation import generate

        return generate(self.model, prompt, new_tokens, compile=self.compile).tokens


class Peer:
    """transformers' generate(), greedy, exactly `new_tokens` tokens, its own cache."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def __call__(self, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, prompt.shape[1]:]


def timed(run, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    synchronize(prompt.device)
    start = time.perf_counter()
    tokens = run(prompt, new_tokens)
    synchronize(prompt.device)
    return time.perf_counter() - start, tokens


def decode_speed(runs: dict, vocab_size: int, points: list[tuple[int, int]], new_tokens: int, rounds: int,
                 device: torch.device, seed: int = 0) -> list[dict]:
    """One row per (batch, prompt): per run its prefill seconds, ms per token, tokens/s and first
    call's extra seconds (compilation); ratios against the others where they are there."""
    if new_tokens < 2:
        raise ValueError("decode_speed needs new_tokens >= 2 (a token's time is a difference of two generations)")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch, prompt_len in points:
        prompt = torch.randint(0, vocab_size, (batch, prompt_len), generator=gen).to(device)
        first = {name: timed(run, prompt, new_tokens)[0] for name, run in runs.items()}  # compiles, warms up
        whole, single, tokens = {n: [] for n in runs}, {n: [] for n in runs}, {}
        for r in range(rounds):
            order = list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]  # none always first
            for name, run in order:
                one = timed(run, prompt, 1)[0]
                seconds, tokens[name] = timed(run, prompt, new_tokens)
                whole[name].append(seconds)
                single[name].append(one)
        row = {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens, "rounds": rounds}
        for name in runs:
            # each round's own difference (the two generations back to back), then the median
            per_token = max(statistics.median(a - b for a, b in zip(whole[name], single[name])), 1e-9) / (new_tokens - 1)
            t_all = statistics.median(whole[name])
            row.update({f"{name}_prefill_s": statistics.median(single[name]), f"{name}_call_s": t_all,
                        f"{name}_ms_per_token": 1e3 * per_token,
                        f"{name}_tokens_per_s": batch / per_token, f"{name}_first_call_extra_s": first[name] - t_all})
        ratios(row, tokens)
        rows.append(row)
    return rows


def ratios(row: dict, tokens: dict) -> None:
    """The figures the decoding goals are stated in, for the runs present in `row`."""
    ms = lambda name: row[f"{name}_ms_per_token"]  # noqa: E731
    names = {k.removesuffix("_ms_per_token") for k in row if k.endswith("_ms_per_token")}
    if {"copy_on", "copy_off"} <= names:
        row["copy_overhead"] = ms("copy_on") / ms("copy_off")
    if {"copy_off", "peer"} <= names:
        row["speedup_vs_peer"] = ms("peer") / ms("copy_off")
        row["call_speedup_vs_peer"] = row["peer_call_s"] / row["copy_off_call_s"]
        row["same_tokens_as_peer"] = bool(torch.equal(tokens["copy_off"].cpu(), tokens["peer"].cpu()))
    if {"copy_on", "peer"} <= names:
        row["copy_on_speedup_vs_peer"] = ms("peer") / ms("copy_on")
    if {"copy_off", "copy_off_eager"} <= names:
        row["speedup_vs_eager"] = ms("copy_off_eager") / ms("copy_off")


def markdown(rows: list[dict]) -> str:
    names = sorted({k.removesuffix("_ms_per_token") for r in rows for k in r if k.endswith("_ms_per_token")})
    extra = [k for k in ("copy_overhead", "speedup_vs_peer", "call_speedup_vs_peer", "copy_on_speedup_vs_peer",
                         "speedup_vs_eager") if k in rows[0]]
    head = ["batch", "prompt", "new", *(f"{n} ms/token" for n in names), *(f"{n} call s" for n in names), *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["batch"]), str(r["prompt"]), str(r["new_tokens"]), *(f"{r[f'{n}_ms_per_token']:.2f}" for n in names),
                 *(f"{r[f'{n}_call_s']:.3f}" for n in names), *(f"{r[k]:.3f}" for k in extra)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
