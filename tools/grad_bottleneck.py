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


@exit_on_usage_error
def main(argv=None) -> int:
    from cplm_dist.checkpoint import complete_tags, load_checkpoint_config, load_model, resolve_checkpoint
    from cplm_dist.config import load_config
    from cplm_dist.distributed import destroy_distributed, evaluation_tp, init_distributed
    from cplm_dist.evaluation.bottleneck import bottleneck_rows, measurement_batches, plot_across_steps
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
        data, source = measurement_batches(cfg, args.batches, args.micro_batch, args.seq_len)
        for enabled in (True, False):
            cfg.copy.enabled = enabled
            torch.manual_seed(cfg.seed)
            rows += bottleneck_rows(build_model(cfg, sequence_parallel=False), cfg, f"{cfg.model.name} at init", data)
    else:
        root, tag = resolve_checkpoint(args.checkpoint)
        tags = complete_tags(root) if args.all else [tag]
        _, info = load_checkpoint_config(root / tags[0])
        dims = init_distributed(evaluation_tp(info["layout"]["tp"]))
        data = None
        for t in tags:
            model, cfg, info = load_model(root / t)
            if data is None:
                data, source = measurement_batches(cfg, args.batches, args.micro_batch, args.seq_len)
            rows += [{"step": info["step"], **r} for r in bottleneck_rows(model, cfg, t, data)]
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
            plot_across_steps(rows, Path(args.plot))
            print(f"wrote {args.plot}")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
