"""Build a CPLM from a config and run forward + backward on random tokens: the smoke test a
user runs before a launch (shapes, tp layout, parameter count, loss at init, step time).

    python tools/model_check.py --config tiny
    python tools/model_check.py --config cplm-135m model.num_layers=2 --seq-len 256
    torchrun --nproc-per-node 2 tools/model_check.py --config tiny parallel.tp=2

At initialisation the loss should sit near log(V): the LM head is near uniform and the copy
head spreads its mass over the context.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from cplm_dist.config.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.distributed import destroy_distributed, init_distributed
from cplm_dist.errors import UsageError
from cplm_dist.model import build_model
from cplm_dist.model.counting import parameter_count


@exit_on_usage_error
def main(argv=None) -> int:
    parser = config_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_intermixed_args(argv)
    cfg = load_from_args(args)
    if cfg.parallel.pp != 1:
        raise UsageError(f"parallel.pp={cfg.parallel.pp}: model_check builds the whole model in each process; "
                         "check pipeline layouts with cplm-train (parallel.pp) or drop parallel.pp")
    dims = init_distributed(cfg.parallel.tp)
    torch.manual_seed(cfg.seed + dims.dp_rank)
    say = print if dims.is_first else (lambda *a, **k: None)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (args.batch_size, args.seq_len), device=model.embedding.weight.device)
    start = time.perf_counter()
    out = model(ids)
    loss = out.nll[:, :-1].mean()
    loss.backward()
    elapsed = time.perf_counter() - start
    grad_norm = math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    counts = parameter_count(cfg)
    say(f"model {cfg.model.name}: {counts['total'] / 1e6:.3f}M parameters "
        f"(copy head {counts['copy_head'] / 1e3:.1f}K), tp={dims.tp_size} dp={dims.dp_size}")
    copy = f"copy {cfg.copy.mix}/{cfg.copy.paste}" if cfg.copy.enabled else "copy off"
    say(f"{copy}: loss {loss.item():.4f} (log V = {math.log(cfg.model.vocab_size):.4f}), "
        f"LM-only {out.lm_nll[:, :-1].mean().item():.4f}, copy share {out.copy_share[:, 1:-1].mean().item():.3f}, "
        f"grad norm (rank 0 shard) {grad_norm:.4f}, forward+backward {elapsed:.3f}s")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
