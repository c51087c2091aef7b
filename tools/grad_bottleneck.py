"""How much of the logits' gradient the LM head suppresses, and how much gradient reaches the
hidden states through the copy head instead (docs/copy_head.md, "Measuring the gradient bottleneck").

    python tools/grad_bottleneck.py --config tiny                       # at initialisation, copy on and off
    python tools/grad_bottleneck.py --checkpoint runs/quickstart-...    # the latest checkpoint of a run
    python tools/grad_bottleneck.py --checkpoint runs/x --all --plot runs/x/bottleneck.png   # across its checkpoints

Batches come from the run's validation data when it is there, else random tokens. Reports per
model: suppressed = 1 - ||G Q||^2 / ||G||^2 (G = dL/dlogits of the LM head's part of the loss, Q an
orthonormal basis of W_lm's columns), for the mixed loss and, with a copy head, for the LM head's
own loss; and the gradient norms reaching h through the LM head and through the copy head.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError


def batches(cfg, n: int, micro: int, seq: int | None):
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.loader import ResumableLoader
    from cplm_dist.errors import DataError

    seq = seq or cfg.data.seq_length
    if seq > cfg.model.max_seq_len:
        raise UsageError(f"--seq-len {seq} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    try:
        cfg.data.seq_length = seq
        data = build_datasets(cfg, (0, n * micro, 0))
        return [(b["input_ids"], b["labels"]) for b in ResumableLoader(data.valid, micro)], "validation data"
    except DataError:
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(4, cfg.model.vocab_size, (micro, seq + 1), generator=g) for _ in range(n)]
        return [(x[:, :-1], x[:, 1:]) for x in ids], "random tokens"


def rows_for(model, cfg, label: str, data) -> list[dict]:
    from cplm_dist.evaluation.bottleneck import measure
    from cplm_dist.evaluation.generation import device_of

    out, device = [], device_of(model)
    for lm_only in ([False, True] if model.copy_head is not None else [False]):
        ms = [measure(model, ids.to(device), labels.to(device), lm_only=lm_only) for ids, labels in data]
        avg = {k: sum(m[k] for m in ms) / len(ms) for k in ms[0] if isinstance(ms[0][k], float)}
        loss_kind = "LM head alone" if lm_only else ("mixture" if model.copy_head is not None else "LM head")
        out.append({"model": label, "copy": "off" if model.copy_head is None else cfg.copy.mix, "loss_of": loss_kind,
                    "vocab": ms[0]["vocab"], "hidden": ms[0]["hidden"], **avg})
    return out


@exit_on_usage_error
def main(argv=None) -> int:
    from cplm_dist.checkpoint import complete_tags, load_checkpoint_config, load_model, resolve_checkpoint
    from cplm_dist.config import load_config
    from cplm_dist.distributed import destroy_distributed, evaluation_tp, init_distributed
    from cplm_dist.model import build_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="a model at initialisation (copy on and copy off)")
    src.add_argument("--checkpoint", help="a run directory or a step-* directory")
    p.add_argument("--all", action="store_true", help="every complete checkpoint of the run")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, help="default: the run's data.seq_length")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="with --all: suppression and gradient norms against the step, as a PNG")
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args(argv)
    rows = []
    if args.config:
        cfg = load_config(args.config, args.overrides)
        cfg.parallel.pp = 1  # a property of the model, not of its layout: measured on whole models
        dims = init_distributed(cfg.parallel.tp)
        data, source = batches(cfg, args.batches, args.micro_batch, args.seq_len)
        for enabled in (True, False):
            cfg.copy.enabled = enabled
            torch.manual_seed(cfg.seed)
            rows += rows_for(build_model(cfg, sequence_parallel=False), cfg, f"{cfg.model.name} at init", data)
    else:
        root, tag = resolve_checkpoint(args.checkpoint)
        tags = complete_tags(root) if args.all else [tag]
        _, info = load_checkpoint_config(root / tags[0])
        dims = init_distributed(evaluation_tp(info["layout"]["tp"]))
        data = None
        for t in tags:
            model, cfg, info = load_model(root / t)
            if data is None:
                data, source = batches(cfg, args.batches, args.micro_batch, args.seq_len)
            rows += [{"step": info["step"], **r} for r in rows_for(model, cfg, t, data)]
    if dims.is_first:
        print(f"gradient bottleneck on {args.batches} x {args.micro_batch} x {args.seq_len or cfg.data.seq_length} tokens of {source}")
        print(f"  {'model':<22} {'copy':<8} {'loss of':<14} {'V':>6} {'D':>5} {'suppressed':>10} {'|dL/dh| LM':>11} {'|dL/dh| copy':>12}")
        for r in rows:
            print(f"  {r['model']:<22} {r['copy']:<8} {r['loss_of']:<14} {r['vocab']:>6} {r['hidden']:>5} "
                  f"{r['suppressed_fraction']:>10.4f} {r['grad_norm_h_via_lm_head']:>11.4g} {r['grad_norm_h_via_copy_head']:>12.4g}")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        if args.plot:
            if not args.all:
                raise UsageError("--plot draws across checkpoints: add --all")
            plot(rows, Path(args.plot))
            print(f"wrote {args.plot}")
    destroy_distributed()
    return 0


def plot(rows: list[dict], path: Path) -> None:
    from cplm_dist.profiling.plotting import figure, lines

    suppression = {}
    for r in rows:
        suppression.setdefault(r["loss_of"], []).append((r["step"], r["suppressed_fraction"]))
    mixed = [r for r in rows if r["loss_of"] in ("mixture", "LM head")]
    norms = {"through the LM head": [(r["step"], r["grad_norm_h_via_lm_head"]) for r in mixed],
             "through the copy head": [(r["step"], r["grad_norm_h_via_copy_head"]) for r in mixed]}
    with figure(path, ncols=2, size=(10, 3.8)) as (a, b):
        lines(a, suppression, xlabel="step", ylabel="suppressed fraction of ||dL/dz||^2", title="LM-head gradient suppression")
        lines(b, norms, xlabel="step", ylabel="||dL/dh||", title="gradient reaching the hidden states")


if __name__ == "__main__":
    sys.exit(main())
