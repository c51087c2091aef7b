"""Context parallelism measured: one training forward and backward of a long sequence at cp = 1, 2,
4 (each cp a fresh job of cp ranks on this machine): peak memory per rank above the built model,
tokens/s, and the bytes a rank receives over cp a step, traced (the profiler's collective counter,
cplm_dist.profiling.measure.CommTimer, on the cp group) against modelled (the formula below), with
the copy head's part apart. A benchmark: figures go to the console (and --json), never into a test.

    python tools/bench_context_parallel.py                            # tiny, T = 4096 8192 16384, cp 1 2 4, CPU
    python tools/bench_context_parallel.py --seq-lens 16384 --cps 1 2 --copy-impl chunked

Modelled bytes a rank receives a step: the planner's cp model
(cplm_dist.profiling.communication.cp_bytes_per_micro_batch, at tp 1 without recomputation), of
which (cp-1)/cp comes from the other ranks (B sequences of T tokens, L layers, n_kv x d_h K and V,
H_c x d_c copy keys; backward's reduce-scatter of the K, V and copy-key gradients moves as much as
the forward's all-gather):
    attention  2 (K, V) x L x B T n_kv d_h x act bytes x 2 (fwd + bwd) x (cp-1)/cp
    copy head  B T H_c d_c x 4 x 2 x (cp-1)/cp  +  B T x 8 (the ids; twice under document masking) x (cp-1)/cp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError


def modelled_bytes(cfg, batch: int, T: int, cp: int, act: int) -> dict:
    """{"attention", "copy"}: the bytes one rank receives over cp in a step (module docstring), K
    and V of `act` bytes an element (4 in fp32, 2 in bf16): (cp-1)/cp of what the planner's cp
    model (cplm_dist.profiling.communication.cp_bytes_per_micro_batch) moves, its copy-head keys
    and ids together as "copy"."""
    from cplm_dist.profiling.communication import cp_bytes_per_micro_batch

    parts = cp_bytes_per_micro_batch(cfg, tp=1, cp=cp, micro_batch=batch, seq_len=T, act_bytes=act,
                                     activation_checkpointing=False)
    whole = {part: sum(sizes.values()) for part, sizes in parts.items()}
    copy = whole.get("copy_head", 0) + whole.get("ids", 0)
    return {"attention": whole.get("attention", 0) * (cp - 1) // cp, "copy": copy * (cp - 1) // cp}


def traced_bytes(timer, cp: int) -> dict:
    """{"attention", "copy"}: the bytes one rank received over cp while `timer` (a CommTimer with
    the copy head as its "copy" region) ran: (cp-1)/cp of each collective's whole buffer (an
    all-gather's output, a reduce-scatter's input). The copy head's are its keys gathered and their
    gradients scattered (its region) and the ids gathered before the layers (cp's list all-gathers,
    ContextShard.gather_ids); the rest is attention's K and V."""
    whole = sum(size for (kind, _), (_, size) in timer.by_name.items() if kind == "cp")
    copy = timer.by_region[("copy", "cp")][1] + timer.by_name[("cp", "all_gather")][1]
    return {"attention": (whole - copy) * (cp - 1) // cp, "copy": copy * (cp - 1) // cp}


def rank_main(args) -> dict:
    import torch.distributed as dist

    from cplm_dist.config import load_config
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.context import ContextShard
    from cplm_dist.profiling.measure import CommTimer, PeakMeter, current_memory_bytes, release_freed_memory_on_cpu

    dims = init_distributed(1, cp_size=args.cp)
    T = args.seq_len
    cfg = load_config(args.config, [f"model.max_seq_len={T}", f"data.seq_length={T}", f"parallel.cp={args.cp}",
                                    f"copy.impl={args.copy_impl}", "seed=0"])
    model = build_model(cfg, device=torch.device("cpu"), activation_checkpointing=False, compile_layers=False)
    g = torch.Generator().manual_seed(0)
    span = torch.randint(3, cfg.model.vocab_size, (args.batch, T // 2), generator=g)
    ids = torch.cat([span, span], dim=1)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    shard = ContextShard.of(dims.cp_group) if args.cp > 1 else None
    mine = (lambda t: shard.take(t)) if shard else (lambda t: t)  # noqa: E731
    model(mine(ids), mine(labels)).nll.sum().backward()  # warm-up: first-call costs out of the figures
    model.zero_grad(set_to_none=True)
    release_freed_memory_on_cpu()
    base = current_memory_bytes(torch.device("cpu"))
    dist.barrier()
    timer = CommTimer(dims, torch.device("cpu"), regions={"copy": model.parts.head.copy_head} if cfg.copy.enabled else {})
    with PeakMeter(torch.device("cpu")) as meter, timer:
        start = time.perf_counter()
        out = model(mine(ids), mine(labels))
        out.nll.sum().backward()
        dist.barrier()
        seconds = time.perf_counter() - start
    nll = out.nll.detach().double().sum()
    if args.cp > 1:
        dist.all_reduce(nll, group=dims.cp_group)
    return {"cp": args.cp, "rank": dims.rank, "seq_len": T, "peak_gb": (meter.peak - base) / 1e9, "seconds": seconds,
            "tokens_per_s": args.batch * T / seconds, "traced": traced_bytes(timer, args.cp), "modelled": modelled_bytes(cfg, args.batch, T, args.cp, act=4),
            "nll_sum": float(nll)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--copy-impl", default="chunked", choices=["dense", "chunked", "auto"])
    p.add_argument("--json", help="write every rank's figures here")
    p.add_argument("--port", type=int, default=29541)
    p.add_argument("--cp", type=int, help=argparse.SUPPRESS)  # a rank of one job, in a child
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    return p


def run_job(args, cp: int, T: int) -> list[dict]:
    own = [a for a in sys.argv[1:]]
    procs = []
    for rank in range(cp):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(cp), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(args.port), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cp))}
        procs.append(subprocess.Popen([sys.executable, __file__, *own, "--cp", str(cp), "--seq-len", str(T)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"cp={cp} T={T} failed: {err.strip()[-800:]}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cp:
        print(json.dumps(rank_main(args)))
        return 0
    bad = [T for T in args.seq_lens for cp in args.cps if T % (2 * cp)]
    if bad or min(args.cps) < 1:
        raise UsageError(f"every --seq-lens value must be divisible by 2 x cp for every --cps value (not {bad[:3]})")
    rows = []
    print(f"{args.config}, batch {args.batch}, copy.impl={args.copy_impl}, one forward + backward, CPU")
    print("| T | cp | peak GB / rank (max) | tokens/s | cp MB / rank traced: attention + copy | modelled | copy head's share | nll sum |")
    print("|---|---|---|---|---|---|---|---|")
    for T in args.seq_lens:
        for cp in args.cps:
            job = run_job(args, cp, T)
            rows += job
            r0 = job[0]
            tr, mo = r0["traced"], r0["modelled"]
            total = tr["attention"] + tr["copy"]
            print(f"| {T} | {cp} | {max(r['peak_gb'] for r in job):.3f} | {min(r['tokens_per_s'] for r in job):,.0f} | "
                  f"{tr['attention'] / 1e6:.1f} + {tr['copy'] / 1e6:.1f} | {mo['attention'] / 1e6:.1f} + {mo['copy'] / 1e6:.1f} | "
                  f"{(tr['copy'] / total if total else 0):.1%} | {r0['nll_sum']:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
