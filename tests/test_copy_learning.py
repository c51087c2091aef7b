"""Behaviour, not shapes: on sequences that repeat a random span, a copy head learns to paste the
repeat within 150 Adam steps, while the same model without it is still near log V."""

import math

import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks

SPAN, BATCH, STEPS, LR = 16, 8, 150, 1e-3
MIXES = {"gate": ["copy.mix=gate"], "sentinel": ["copy.mix=sentinel"], "joint": ["copy.mix=joint"],
         "off": ["copy.enabled=false"]}


def repeated_spans(batch, vocab, g):
    span = torch.randint(0, vocab, (batch, SPAN), generator=g)
    return torch.cat([span, span], dim=1)  # (B, 2 * SPAN)


def _train_worker():
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model

    init_distributed(1)
    results = {}
    for name, overrides in MIXES.items():
        cfg = load_config("tiny", overrides)
        model = build_model(cfg)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        g = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            loss = model(repeated_spans(BATCH, cfg.model.vocab_size, g)).nll[:, :-1].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            out = model(repeated_spans(64, cfg.model.vocab_size, torch.Generator().manual_seed(99)))
        # positions SPAN..2*SPAN-2 predict a token of the repeat; 0..SPAN-2 are unpredictable
        results[name] = {"repeat": out.nll[:, SPAN:-1].mean().item(), "first": out.nll[:, : SPAN - 1].mean().item(),
                         "share": out.copy_share[:, SPAN:-1].mean().item()}
    return results


def test_copy_head_learns_to_paste_repeats_long_before_the_plain_lm():
    res = run_ranks(_train_worker, 1, timeout=300)[0]
    log_v = math.log(load_config("tiny").model.vocab_size)
    print({k: {m: round(v, 3) for m, v in r.items()} for k, r in res.items()})
    assert res["off"]["repeat"] > log_v - 2.0, "the plain LM is not expected to copy yet"
    assert res["gate"]["repeat"] < 1.0 and res["gate"]["share"] > 0.8
    for mix in ("gate", "sentinel", "joint"):
        assert res[mix]["repeat"] < res["off"]["repeat"] - 1.5, mix
    for name, r in res.items():  # nothing to learn in the first half: all stay near log V
        assert abs(r["first"] - log_v) < 0.75, name
