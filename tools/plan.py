"""Plan a training layout: which tp x cp x pp x dp x ZeRO x micro-batch x checkpointing x sequence
parallelism (x ep x expert_tp for a sparse model) fits a cluster, and which is fastest
(cplm_dist/profiling/planner.py, docs/parallelism.md, docs/moe.md).

    python tools/plan.py --config cplm-1.7b --gpus 8
    python tools/plan.py --config cplm-1.7b --gpus 8 --seq-len 32768 --global-batch 64 model.max_seq_len=32768
    python tools/plan.py --config cplm-70b --gpus 512 --seq-len 4096 --global-batch 1024 --top 5
    python tools/plan.py --config configs/runs/cplm-7b.yaml --gpus 64 --write configs/runs/cplm-7b.yaml
    python tools/plan.py --config qwen3-30b-a3b --gpus 64 --seq-len 4096 --global-batch 512   # ep too

The sequence length and global batch default to the config's data.seq_length and
train.global_batch_size; precision is train.precision. Predictions, not measurements: compute at
--achievable x the GPU's dense peak, communication at the stated bandwidths. --write sets the
chosen layout's fields in a run config, parallel.pp and parallel.cp included (a sparse model's parallel.ep and expert_tp) (a file keeps its other sections; a
shipped name becomes `base: <name>`; cplm_dist/profiling/layout_config.py, cplm_dist/config/editing.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from cplm_dist.config import divisors
from cplm_dist.config.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.errors import UsageError
from cplm_dist.model.counting import parameter_count
from cplm_dist.profiling.layout_config import PLAN_NOTE, layout_overrides, write_run_config
from cplm_dist.profiling.planner import Cluster, Plan, plan
COLUMNS = [("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp"), ("zero_stage", "ZeRO"), ("micro_batch", "micro"), ("accumulation", "accum"),
           ("activation_checkpointing", "ckpt"), ("sequence_parallel", "sp"), ("memory_gib", "GiB"),
           ("compute_s", "compute s"), ("tp_comm_s", "tp s"), ("cp_comm_s", "cp s"), ("exposed_dp_s", "dp s (exposed)"), ("optimizer_s", "optimizer s"),
           ("pp_comm_s", "pp s"), ("bubble", "bubble"), ("pp_schedule", "schedule"), ("step_s", "step s"), ("mfu", "MFU"),
           ("tokens_per_s", "tokens/s")]
# a sparse model's (model.moe): its expert layout after dp, its dispatcher's exposed all-to-alls after cp's
EXPERT_COLUMNS = {"dp": [("ep", "ep"), ("expert_tp", "expert tp")], "cp_comm_s": [("ep_comm_s", "ep s")]}


def _cell(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def table(plans: list[Plan], experts: bool = False) -> str:
    """The plans as a markdown table; `experts`: a sparse model's columns too (EXPERT_COLUMNS)."""
    columns = [c for key, h in COLUMNS for c in [(key, h), *(EXPERT_COLUMNS.get(key, []) if experts else [])]]
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for p in plans:
        row = p.as_dict()
        cells = [(f"{row[k]:.1%}" if k in ("mfu", "bubble") else f"{row[k]:.2f}" if k == "memory_gib" else
                  f"{row[k]:,.0f}" if k == "tokens_per_s" else f"{row[k]:.3g}" if k.endswith("_s") else _cell(row[k]))
                 for k, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def confirm(best: Plan, args, cluster: Cluster, seq_len: int, global_batch: int) -> int:
    """--dry-run: trace the best layout (cplm_dist.profiling.dry_run) on a device of --gpu-gb, its
    step beside the planner's for `cluster`; its exit code (0 fits, 1 does not)."""
    from cplm_dist.config import load_config
    from cplm_dist.profiling.dry_run import dry_run
    from cplm_dist.profiling.dry_run_report import device_named, report

    chosen = load_config(args.config, [*args.overrides, *layout_overrides(best, seq_len, global_batch)])
    device = device_named("h100" if args.gpu_gb <= 80 else "h200", args.gpu_gb)
    print(f"dry run of the best layout ({device.name} figures, {args.gpu_gb:g} GiB):", flush=True)
    return report(dry_run(chosen, gpus=args.gpus, device=device, cluster=cluster, progress=lambda line: print(line, flush=True)), None)


def check_ep(cfg, ep: int, gpus: int) -> None:
    """--ep: one line where no layout could take it (config.sparse's rules: ep divides the experts
    and a pipeline stage's ranks, so at least the GPUs)."""
    e = cfg.model.moe.num_experts
    if ep < 1 or (ep > 1 and not e):
        raise UsageError(f"--ep {ep}: must be a positive integer, and > 1 only for a sparse model (model.moe.num_experts)")
    if e and e % ep:
        raise UsageError(f"--ep {ep} does not divide model.moe.num_experts={e}: choose ep from "
                         f"{[d for d in divisors(e)]}")
    if gpus % ep:
        raise UsageError(f"--ep {ep} does not divide --gpus {gpus} (ep x expert_tp divides a pipeline stage's tp x cp x dp ranks)")


def max_pp(cfg, args) -> int:
    """The largest pipeline degree the planner tried: pp divides the GPUs and is at most the layers."""
    limit = min(args.gpus, cfg.model.num_layers, args.max_pp or args.gpus)
    return max(d for d in divisors(args.gpus) if d <= limit)


@exit_on_usage_error
def main(argv=None) -> int:
    p = config_parser(__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU (GiB)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense peak per GPU at the training precision")
    p.add_argument("--achievable", type=float, default=0.48,
                   help="fraction of peak the compute reaches (default: the MFU measured for cplm-1.7b on one H200)")
    p.add_argument("--intra-gbps", type=float, default=360.0, help="GB/s per GPU inside a node (ring bus bandwidth)")
    p.add_argument("--inter-gbps", type=float, default=40.0, help="GB/s per GPU between nodes")
    p.add_argument("--overlap", type=float, default=0.8, help="share of ZeRO communication under compute that it hides")
    p.add_argument("--max-pp", type=int, help="largest pipeline degree to consider (default: any; 1: no pipelining)")
    p.add_argument("--max-cp", type=int, help="largest context-parallel degree to consider (default: any; 1: none)")
    p.add_argument("--ep", type=int, help="a sparse model's expert parallelism: only this ep (default: any dividing "
                                          "model.moe.num_experts)")
    p.add_argument("--seq-len", type=int, help="default: data.seq_length")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: train.global_batch_size)")
    p.add_argument("--top", type=int, default=8, help="layouts to print")
    p.add_argument("--write", metavar="YAML", help="write the best layout into this run config")
    p.add_argument("--dry-run", action="store_true",
                   help="confirm the best layout by tracing the real model at its shapes (tools/dry_run.py; minutes)")
    args = p.parse_intermixed_args(argv)
    cfg = load_from_args(args)
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise UsageError(f"--gpus {args.gpus} and --gpus-per-node {args.gpus_per_node} must be positive")
    if not 0 < args.achievable <= 1 or not 0 <= args.overlap <= 1:
        raise UsageError(f"--achievable {args.achievable} must be in (0, 1] and --overlap {args.overlap} in [0, 1]")
    if args.max_pp is not None and args.max_pp < 1:
        raise UsageError(f"--max-pp {args.max_pp} must be a positive integer")
    if args.max_cp is not None and args.max_cp < 1:
        raise UsageError(f"--max-cp {args.max_cp} must be a positive integer")
    if args.ep is not None:
        check_ep(cfg, args.ep, args.gpus)
    seq = args.seq_len or cfg.data.seq_length
    batch = args.global_batch or cfg.train.global_batch_size
    if (args.write or args.dry_run) and seq > cfg.model.max_seq_len:
        raise UsageError(f"--seq-len {seq} exceeds model.max_seq_len={cfg.model.max_seq_len}: the layout written or traced "
                         f"would not load; add model.max_seq_len={seq} (and a model.rope_theta for that length)")
    cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, memory_gib=args.gpu_gb,
                      peak_tflops=args.peak_tflops, achievable=args.achievable, intra_gbps=args.intra_gbps,
                      inter_gbps=args.inter_gbps, overlap=args.overlap)
    fits, considered = plan(cfg, cluster, seq_len=seq, global_batch=batch, max_pp=args.max_pp, max_cp=args.max_cp, ep=args.ep)
    n = parameter_count(cfg)["total"]
    head = (f"{cfg.model.name} ({n / 1e9:.2f}B parameters, {cfg.train.precision}) on {args.gpus} GPUs "
            f"({args.gpus_per_node} a node, {args.gpu_gb:g} GiB), {batch} x {seq} tokens a step: "
            f"{len(fits)} of {considered} layouts fit")
    print(head)
    if not fits:
        if args.max_pp == 1:
            print(f"no layout fits {cluster.headroom:.0%} of {args.gpu_gb:g} GiB at pp=1: this size needs pipeline "
                  "parallelism (drop --max-pp), more GPUs or a smaller global batch")
        else:
            print(f"no layout fits {cluster.headroom:.0%} of {args.gpu_gb:g} GiB, even with pipeline parallelism (pp up to "
                  f"{max_pp(cfg, args)}): this size needs more GPUs, more memory a GPU or a smaller global batch")
        return 1
    sparse = cfg.model.moe.num_experts > 0
    print(table(fits[: args.top], experts=sparse))
    best = fits[0]
    if best.pp > 1 and not any(p.pp == 1 for p in fits):
        print(f"no layout fits {cluster.headroom:.0%} of {args.gpu_gb:g} GiB without pipeline parallelism: "
              f"this size needs pp > 1 on {args.gpus} GPUs")
    if best.cp > 1 and not any(p.cp == 1 for p in fits):
        print(f"no layout fits {cluster.headroom:.0%} of {args.gpu_gb:g} GiB without context parallelism: "
              f"{seq} tokens a sequence need cp > 1 on {args.gpus} GPUs")
    experts = f" ep={best.ep} expert_tp={best.expert_tp}" if sparse else ""
    print(f"best: tp={best.tp} cp={best.cp} pp={best.pp} dp={best.dp}{experts} ZeRO-{best.zero_stage} micro {best.micro_batch} x accumulation {best.accumulation}, "
          f"checkpointing {'on' if best.activation_checkpointing else 'off'}, sequence parallel "
          f"{'on' if best.sequence_parallel else 'off'}: predicted {best.step_s:.3g} s a step"
          f"{f' ({best.pp_schedule}, bubble {best.bubble:.1%})' if best.pp > 1 else ''}{f' (cp {best.cp_comm_s:.3g} s exposed)' if best.cp > 1 else ''}"
          f"{f' (ep all-to-all {best.ep_comm_s:.3g} s exposed)' if best.ep > 1 else ''}"
          f", MFU {best.mfu:.1%}, {best.memory_gib:.1f} GiB a GPU")
    if args.dry_run:
        status = confirm(best, args, cluster, seq, batch)
        if status:
            return status
    if args.write:
        note = (f"{PLAN_NOTE} --gpus {args.gpus} (a prediction, docs/parallelism.md): predicted {best.step_s:.3g} s "
                f"a step{f' (pp={best.pp} {best.pp_schedule}, bubble {best.bubble:.1%})' if best.pp > 1 else ''}"
                f"{f' (cp={best.cp})' if best.cp > 1 else ''}{f' (ep={best.ep})' if best.ep > 1 else ''}, MFU {best.mfu:.1%}, "
                f"{best.memory_gib:.1f} GiB a GPU")
        write_run_config(Path(args.write), args.config, best, seq, batch, note)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
