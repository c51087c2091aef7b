"""Sparse (mixture-of-experts) training throughput on CPU: expert parallelism against a dense model
of the same active parameters, and the grouped-GEMM expert path against megatron's per-expert loop.

    OMP_NUM_THREADS=1 python tools/bench_moe.py                       # both parts, the quickstart shape
    OMP_NUM_THREADS=1 python tools/bench_moe.py --parts ep --json runs/bench_moe.json

Part `ep` (2 ranks on gloo, ZeRO-1, the quickstart model and batch): dense at dp 2; sparse (every
MLP 8 experts of width ffn / 2, top-2: the dense model's active parameters, as tools/ablate.py
--backbones sparse) at ep 1 x dp 2 and at ep 2 (each rank 4 experts). Part `impl` (one process):
model.moe.expert_impl sequential (megatron's loop over local experts) against grouped (one
torch._grouped_mm for every expert's fc1 and one for fc2: cplm_dist.model.moe_grouped) at the same
8 x ffn/2 top-2 layer and at a fine-grained one, 64 experts of width ffn / 8 with top-8 (the
same active parameters, the Qwen3-MoE / DeepSeek shape), where the loop runs 64 small GEMMs a layer.

Each case is one tools/cplm_profile.py launch (its clean steps' median, and its instrumented
steps' breakdown: forward, backward, optimizer and communication by group, the expert-parallel
all-to-alls filed under `ep`), so a number here is that tool's. The cases run --rounds times,
interleaved (a shared machine drifts), and the table gives each case's median over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cplm_dist.config import load_config

PROFILE = "cplm_dist_tools.cplm_profile"  # this package's profiler, as installed


def sparse(base: str, overrides: list[str], experts: int, top_k: int) -> list[str]:
    """model.moe of `experts` experts of width ffn / top_k, top_k a token: the dense model's active parameters."""
    ffn = load_config(base, overrides).model.ffn_hidden_size
    return [f"model.moe.num_experts={experts}", f"model.moe.top_k={top_k}", f"model.moe.ffn_hidden_size={ffn // top_k}"]


def cases(base: str, overrides: list[str], parts: list[str]) -> list[tuple[str, str, int, list[str]]]:
    """(part, name, processes, overrides) of every case."""
    coarse, fine = sparse(base, overrides, 8, 2), sparse(base, overrides, 64, 8)
    out = []
    if "ep" in parts:
        out += [("ep", "dense, dp 2", 2, []), ("ep", "sparse 8 x top-2, ep 1 x dp 2", 2, coarse),
                ("ep", "sparse 8 x top-2, ep 2", 2, [*coarse, "parallel.ep=2"])]
    if "impl" in parts:
        out += [("impl", "dense", 1, [])]
        for label, moe in (("8 x top-2", coarse), ("64 x top-8", fine)):
            out += [("impl", f"sparse {label}, {impl}", 1, [*moe, f"model.moe.expert_impl={impl}"]) for impl in ("sequential", "grouped")]
    return out


def profile(base: str, overrides: list[str], processes: int, steps: int, json_path: Path, log) -> dict:
    """One cplm_profile launch (torch.distributed.run for several processes); its JSON result."""
    launcher = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
    cmd = [*launcher, "-m", PROFILE, "--config", base, "--steps", str(steps), "--warmup", "3", "--breakdown-steps", "3",
           "--csv", "", "--json", str(json_path), "train.zero_stage=1", *overrides]
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(json_path.read_text())


def summary(results: list[dict]) -> dict:
    """A case's figures over rounds (medians): step time, tokens/s, the instrumented phases and the
    all-to-all's time and share of the instrumented step (forward + backward + optimizer)."""
    def med(key):
        values = [r[key] for r in results if r.get(key) is not None]
        return statistics.median(values) if values else None

    phases = [r["forward_s"] + r["backward_s"] + r["optimizer_s"] for r in results]
    return {"step_time_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"), "forward_s": med("forward_s"),
            "backward_s": med("backward_s"), "optimizer_s": med("optimizer_s"), "comm_ep_s": med("comm_ep_s"),
            "comm_ep_mb": med("comm_ep_mb"), "comm_dp_s": med("comm_dp_s"),
            "ep_share": statistics.median(r["comm_ep_s"] / p for r, p in zip(results, phases)),
            "parameters": results[0]["parameters"], "active_parameters": results[0]["active_parameters"],
            "step_times_s": [r["step_time_s"] for r in results]}


def markdown(rows: dict) -> str:
    lines = ["| part | case | parameters total / active | step s (median; rounds) | tokens/s | fwd / bwd / opt s "
             "(instrumented) | all-to-all s, MB a step | all-to-all share | dp s |", "|---" * 9 + "|"]
    for (part, name), s in rows.items():
        rounds = ", ".join(f"{t:.3f}" for t in s["step_times_s"])
        lines.append(f"| {part} | {name} | {s['parameters'] / 1e6:.2f}M / {s['active_parameters'] / 1e6:.2f}M | "
                     f"{s['step_time_s']:.3f} ({rounds}) | {s['tokens_per_s']:,.0f} | {s['forward_s']:.3f} / "
                     f"{s['backward_s']:.3f} / {s['optimizer_s']:.3f} | {s['comm_ep_s']:.3f}, {s['comm_ep_mb']:.1f} | "
                     f"{s['ep_share']:.1%} | {s['comm_dp_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--parts", nargs="+", default=["ep", "impl"], choices=["ep", "impl"])
    p.add_argument("--steps", type=int, default=8, help="clean, timed steps a launch")
    p.add_argument("--rounds", type=int, default=2, help="times each case runs, interleaved")
    p.add_argument("--json", help="write every case's summary here")
    p.add_argument("--log", default="runs/bench_moe.log", help="the launches' output")
    p.add_argument("overrides", nargs="*", help="config overrides for every case")
    args = p.parse_args(argv)
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    todo = cases(args.config, args.overrides, args.parts)
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, open(args.log, "a") as log:
        for r in range(args.rounds):
            for i, (part, name, processes, overrides) in enumerate(todo):
                print(f"round {r + 1}/{args.rounds}: {part} {name} ...", flush=True)
                out = profile(args.config, [*args.overrides, *overrides], processes, args.steps, Path(tmp) / f"{r}-{i}.json", log)
                results.setdefault((part, name), []).append(out)
    rows = {key: summary(rs) for key, rs in results.items()}
    if args.json:
        Path(args.json).write_text(json.dumps([{"part": k[0], "case": k[1], **v} for k, v in rows.items()], indent=2) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
