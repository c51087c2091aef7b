"""Throughput and memory of any config under any launch, on synthetic tokens (no dataset).

    python tools/cplm_profile.py --config tiny                                    # CPU, one process
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/cplm_profile.py --config tiny parallel.tp=2
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/cplm_profile.py --config tiny parallel.pp=2 --accumulation 4
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/cplm_profile.py --config tiny parallel.cp=2     # context parallel
    torchrun --nproc-per-node 8 tools/cplm_profile.py --config cplm-1.7b train.precision=bf16 train.zero_stage=2 --seq-len 2048
    python tools/cplm_profile.py --config tiny --sweep zero=0,1,2 micro=1,2,4 --nproc 2     # each point a fresh launch
    python tools/cplm_profile.py --config cplm-135m --copy-overhead                 # copy on / off, alternating
    python tools/cplm_profile.py --config cplm-135m --peer                          # against transformers' Llama
    python tools/cplm_profile.py --config cplm-135m --decode                        # decoding, copy on / off (compiled step)
    python tools/cplm_profile.py --config cplm-135m --decode --peer --decode-eager  # and transformers' generate, and eager

Reports tokens/s (global, per device), the step-time breakdown (forward, backward, optimizer and
its share of the step: AdamW's elementwise step, or Muon's Newton-Schulz and gathers;
tensor-parallel, data-parallel / ZeRO, context-parallel (parallel.cp), expert-parallel (parallel.ep: the token
all-to-alls) and pipeline communication), TFLOP/s and MFU (cplm_dist.training.throughput),
peak memory and the estimate of cplm_dist.profiling.memory, as a console table, a JSON file (--json) and one
row appended to a CSV (--csv). --trace FILE writes a torch.profiler Chrome trace of one step.

The step measured is training's own, built as cplm-train builds it (cplm_dist.training.step.build_train_step);
the timing is cplm_dist.profiling.measure's, the sweep cplm_dist.profiling.sweep's.
"""

from __future__ import annotations

import copy as copylib
import json
import sys
from pathlib import Path

import torch

from cplm_dist.config import Config, batch_layout
from cplm_dist.config.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.errors import UsageError
from cplm_dist.profiling.memory import estimate, stage_estimates
from cplm_dist.profiling.records import append_csv, report, table
from cplm_dist.profiling.sweep import SWEEPABLE, parse_sweep, run_sweep, sweep_points
from cplm_dist.training.step import build_train_step as build


def parser():
    p = config_parser(__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: data.seq_length)")
    p.add_argument("--accumulation", type=int, default=None, help="micro-batches per step (global = micro x this x "
                   "dp); default: what the config's train.global_batch_size gives at this dp, as the run would step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="clean, timed steps")
    p.add_argument("--breakdown-steps", type=int, default=2, help="instrumented steps for the time breakdown")
    p.add_argument("--trace", help="write a torch.profiler Chrome trace of one step to this file")
    p.add_argument("--json", help="write the result as JSON to this file")
    p.add_argument("--csv", default="runs/profile/profile.csv", help="append one row per run here ('' to skip)")
    p.add_argument("--label", default="", help="a name for this run in the CSV")
    p.add_argument("--sweep", nargs="+", metavar="NAME=V1,V2", help=f"grid over {sorted(SWEEPABLE)}; each point a fresh launch")
    p.add_argument("--nproc", type=int, help="--sweep: processes per point (default: the point's tp x cp x pp)")
    p.add_argument("--out-dir", default="runs/profile", help="--sweep: CSV and plots go here")
    p.add_argument("--copy-overhead", action="store_true", help="copy head on and off, alternating, same shapes")
    p.add_argument("--peer", action="store_true", help="also transformers' LlamaForCausalLM, same shapes, tp=1")
    p.add_argument("--rounds", type=int, default=3, help="--copy-overhead / --peer / --decode: alternations")
    p.add_argument("--decode", action="store_true", help="decoding tokens/s with the KV cache, copy on and off (cplm_dist.profiling.decoding)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8], metavar="B")
    p.add_argument("--decode-prompts", type=int, nargs="+", default=[512, 2048], metavar="T", help="prompt lengths")
    p.add_argument("--new-tokens", type=int, default=64, help="--decode: tokens generated after each prompt")
    p.add_argument("--decode-eager", action="store_true", help="--decode: also the copy-off model's eager decode step")
    p.add_argument("--no-compile", action="store_true", help="--decode: decode eager (no compiled step)")
    p.add_argument("--report", metavar="CSV", help="print a markdown table of a profile CSV and exit")
    return p


# --- one configuration, this launch --------------------------------------------------------------


def setup(cfg: Config, args):
    from cplm_dist.distributed import default_device, init_distributed
    from cplm_dist.profiling.measure import release_freed_memory_on_cpu

    from cplm_dist.config.sparse import expert_tp

    dims = init_distributed(cfg.parallel.tp, pp_size=cfg.parallel.pp, cp_size=cfg.parallel.cp, ep_size=cfg.parallel.ep,
                            expert_tp_size=expert_tp(cfg))
    device = default_device()
    if device.type == "cpu":
        release_freed_memory_on_cpu()
    seq = args.seq_len or cfg.data.seq_length
    if seq > cfg.model.max_seq_len:
        raise UsageError(f"--seq-len {seq} exceeds model.max_seq_len={cfg.model.max_seq_len}: raise it with model.max_seq_len={seq}")
    p = cfg.parallel
    unit = 2 * p.cp * (p.tp if p.sequence_parallel and p.tp > 1 and p.cp > 1 else 1)
    if p.cp > 1 and seq % unit:
        raise UsageError(f"--seq-len {seq} is not divisible by {unit}, which parallel.cp={p.cp} needs (2 x cp chunks"
                         f"{', each split over tp' if unit > 2 * p.cp else ''})")
    if args.accumulation is None:  # the run's own step: its global batch at this dp (ZeRO's reduce once a step)
        per = cfg.train.micro_batch_size * dims.dp_size
        if cfg.train.global_batch_size % per:
            raise UsageError(f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of micro x dp = "
                             f"{cfg.train.micro_batch_size} x {dims.dp_size}: set it, or give --accumulation N")
        args.accumulation = cfg.train.global_batch_size // per
    cfg.train.global_batch_size = cfg.train.micro_batch_size * args.accumulation * dims.dp_size
    cfg.data.seq_length = seq
    return dims, device, seq, batch_layout(cfg, dims.dp_size)


def describe(cfg: Config, dims, seq: int, accumulation: int, args, mode: str | None = None) -> dict:
    import datetime

    from cplm_dist.model.counting import active_parameters, parameter_count

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "date": datetime.date.today().isoformat(), "device": device, "config": cfg.model.name,
        "parameters": parameter_count(cfg)["total"], "active_parameters": active_parameters(cfg),
        "experts": cfg.model.moe.num_experts, "expert_impl": cfg.model.moe.expert_impl, "ep": dims.ep_size, "copy": f"{cfg.copy.mix}/{cfg.copy.paste}" if cfg.copy.enabled else "off", "optimizer": cfg.optim.name,
        "copy_impl": f"{cfg.copy.impl}/{cfg.copy.chunk_size}" if cfg.copy.impl == "chunked" else cfg.copy.impl,
        "tp": dims.tp_size, "pp": dims.pp_size, "cp": dims.cp_size, "dp": dims.dp_size, "world": dims.world_size, "zero": cfg.train.zero_stage,
        "precision": cfg.train.precision, "micro_batch": cfg.train.micro_batch_size, "accumulation": accumulation,
        "global_batch": cfg.train.global_batch_size, "seq_len": seq, "activation_checkpointing": cfg.train.activation_checkpointing,
        "label": args.label, **({"mode": mode} if mode else {}),
    }


def profile_one(cfg: Config, args) -> dict:
    from cplm_dist.model.copy_head import CopyHead
    from cplm_dist.profiling.measure import current_memory_bytes, measure

    dims, device, seq, accumulation = setup(cfg, args)
    baseline = current_memory_bytes(device)
    step = build(cfg, dims, device)
    result = describe(cfg, dims, seq, accumulation, args)
    result.update(measure(step, cfg, dims, warmup=args.warmup, steps=args.steps,
                          breakdown_steps=args.breakdown_steps, seq_len=seq, device=device,
                          baseline_bytes=baseline, trace_path=args.trace if dims.is_first else None))
    # this rank's stage (the measured figure is rank 0's: the first pipeline stage)
    est = stage_estimates(cfg, tp=dims.tp_size, dp=dims.dp_size, micro_batch=cfg.train.micro_batch_size, seq_len=seq)[dims.pp_rank]
    paths = {m.last_path for m in step.engine.module.modules() if isinstance(m, CopyHead) and m.last_path}
    if paths:  # what copy.impl ran on this device (auto: flex or chunked, one block: dense)
        result["copy_impl"] += " -> " + "/".join(sorted(paths))
    result["estimated_memory_gb"] = est.total / 1e9
    result["estimate_error"] = est.total / 1e9 / result["step_memory_gb"] - 1 if result["step_memory_gb"] > 0 else None
    return result


# --- copy on / off and the transformers peer, alternating in one process ------------------------


def copy_off(cfg: Config) -> Config:
    off = copylib.deepcopy(cfg)
    off.copy.enabled = False
    return off


def alternated(cfg: Config, args, dims, device, seq: int, makers: dict) -> tuple[dict, dict]:
    """cplm_dist.profiling.measure.alternate of the TrainSteps `makers` build: (its result, as flat fields)."""
    from cplm_dist.profiling.measure import alternate, measure_building

    steps = {name: measure_building(make, device) for name, make in makers.items()}
    res = alternate(steps, cfg, dims, device, seq, warmup=args.warmup, steps_per_round=args.steps, rounds=args.rounds)
    return res, {f"{k}_{m}": v for k, r in res.items() for m, v in r.items()}


def copy_overhead(cfg: Config, args) -> dict:
    dims, device, seq, accumulation = setup(cfg, args)
    off = copy_off(cfg)
    cfg.copy.enabled = True
    res, fields = alternated(cfg, args, dims, device, seq, {"copy_on": lambda: build(cfg, dims, device),
                                                            "copy_off": lambda: build(off, dims, device)})
    est_on, est_off = (estimate(c, tp=dims.tp_size, dp=dims.dp_size, micro_batch=cfg.train.micro_batch_size, seq_len=seq)
                       for c in (cfg, off))
    return {**describe(cfg, dims, seq, accumulation, args, "copy-overhead"), **fields,
            "step_time_ratio": res["copy_on"]["step_time_s"] / res["copy_off"]["step_time_s"],
            "memory_difference_gb": res["copy_on"]["memory_gb"] - res["copy_off"]["memory_gb"],
            "estimated_memory_difference_gb": (est_on.total - est_off.total) / 1e9}


class TransformersPeer(torch.nn.Module):
    """transformers' own class of our backbone and shapes (LlamaForCausalLM for llama:
    cplm_dist.interop.hf.directory.transformers_config) behind our forward signature, with its own
    (standard) cross-entropy loss."""

    def __init__(self, cfg: Config, device):
        super().__init__()
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise UsageError("--peer needs transformers: pip install -e '.[bench]'") from None
        from cplm_dist.interop.hf.directory import transformers_config

        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_config(transformers_config(cfg.model, attn_implementation="sdpa")).to(device)

    def forward(self, input_ids, labels):
        from cplm_dist.model.loss import TokenLoss

        logits = self.model(input_ids=input_ids).logits
        nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        nll = nll.view_as(labels)
        return TokenLoss(nll, nll.detach(), torch.zeros_like(nll))


def peer(cfg: Config, args) -> dict:
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1:
        raise UsageError("--peer compares at parallel.tp=1, parallel.pp=1 (transformers' Llama has no tensor or pipeline parallelism)")
    dims, device, seq, accumulation = setup(cfg, args)
    off = copy_off(cfg)
    res, fields = alternated(cfg, args, dims, device, seq, {
        "ours_copy_on": lambda: build(cfg, dims, device), "ours_copy_off": lambda: build(off, dims, device),
        "hf_llama": lambda: build(off, dims, device, TransformersPeer(cfg, device))})
    return {**describe(cfg, dims, seq, accumulation, args, "peer"), **fields,
            "speedup_copy_off_vs_hf": res["ours_copy_off"]["tokens_per_s"] / res["hf_llama"]["tokens_per_s"],
            "speedup_copy_on_vs_hf": res["ours_copy_on"]["tokens_per_s"] / res["hf_llama"]["tokens_per_s"]}


def decode(cfg: Config, args) -> dict:
    """Decoding through generate(): copy on and off (compiled unless --no-compile), with --peer
    transformers' generate() on the copy-off weights, with --decode-eager the eager step (tp = 1)."""
    from cplm_dist.model import build_model
    from cplm_dist.profiling.decoding import Ours, Peer, decode_speed, markdown, peer_model

    longest = max(args.decode_prompts) + args.new_tokens
    if longest > cfg.model.max_seq_len:
        raise UsageError(f"--decode: prompt {max(args.decode_prompts)} + --new-tokens {args.new_tokens} exceeds "
                         f"model.max_seq_len={cfg.model.max_seq_len}: add model.max_seq_len={longest} (RoPE extends)")
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1:
        raise UsageError("--decode measures one process: use parallel.tp=1 and parallel.pp=1")
    if args.new_tokens < 2:
        raise UsageError(f"--new-tokens {args.new_tokens}: --decode needs at least 2 (a token's time is a difference)")
    dims, device, seq, accumulation = setup(cfg, args)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" and device.type == "cuda" else torch.float32
    off = copy_off(cfg)
    cfg.copy.enabled = True
    models = {name: build_model(c, device=device, dtype=dtype, compile_layers=False, sequence_parallel=False).eval()
              for name, c in (("copy_on", cfg), ("copy_off", off))}
    compiled = not args.no_compile
    runs = {name: Ours(model, compiled) for name, model in models.items()}
    if args.decode_eager:
        runs["copy_off_eager"] = Ours(models["copy_off"], False)
    if args.peer:
        try:
            runs["peer"] = Peer(peer_model(models["copy_off"], off, device))
        except ImportError:
            raise UsageError("--peer needs transformers: pip install -e '.[bench]'") from None
    points = [(b, t) for b in args.decode_batches for t in args.decode_prompts]
    rows = decode_speed(runs, cfg.model.vocab_size, points, args.new_tokens, args.rounds, device, seed=cfg.seed)
    print(markdown(rows), flush=True)
    return {**describe(cfg, dims, seq, accumulation, args, "decode"), "dtype": str(dtype).removeprefix("torch."),
            "compiled": compiled, "points": rows}


# --- sweeps: each point a fresh launch of this tool ----------------------------------------------


def sweep(args) -> int:
    grid = parse_sweep(args.sweep)
    points, skipped = sweep_points(args.config, args.overrides, grid)  # every point checked before any launch
    for point, reason in skipped:
        print(f"sweep point {point} skipped: {reason}", flush=True)

    def point_command(point: dict, overrides: list[str], result_file: Path) -> list[str]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--config", args.config, *args.overrides, *overrides,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--breakdown-steps", str(args.breakdown_steps),
               *(["--accumulation", str(args.accumulation)] if args.accumulation else []), "--json", str(result_file), "--csv", "",
               "--label", args.label or " ".join(f"{k}={v}" for k, v in point.items())]
        return cmd + (["--seq-len", str(args.seq_len)] if args.seq_len else [])

    run_sweep(points, grid, Path(args.out_dir), point_command, args.nproc)
    return 0


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.sweep:
        return sweep(args)
    cfg = load_from_args(args)
    from cplm_dist.distributed import destroy_distributed

    mode = copy_overhead if args.copy_overhead else decode if args.decode else peer if args.peer else profile_one
    result = mode(cfg, args)
    if torch.distributed.get_rank() == 0:
        print(table(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        if not args.decode:  # one row per point, not a profile row
            append_csv(args.csv, result)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
