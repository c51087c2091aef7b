"""Throughput and memory of any config under any launch, on synthetic tokens (no dataset).

    python tools/cplm_profile.py --config tiny                                    # CPU, one process
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/cplm_profile.py --config tiny parallel.tp=2
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/cplm_profile.py --config tiny parallel.pp=2 --accumulation 4
    torchrun --nproc-per-node 8 tools/cplm_profile.py --config cplm-1.7b train.precision=bf16 train.zero_stage=2 --seq-len 2048
    python tools/cplm_profile.py --config tiny --sweep zero=0,1,2 micro=1,2,4 --nproc 2     # each point a fresh launch
    python tools/cplm_profile.py --config cplm-135m --copy-overhead                 # copy on / off, alternating
    python tools/cplm_profile.py --config cplm-135m --peer                          # against transformers' Llama
    python tools/cplm_profile.py --config cplm-135m --decode                        # KV-cache decoding, copy on / off

Reports tokens/s (global, per device), the step-time breakdown (forward, backward, optimizer;
tensor-parallel and data-parallel / ZeRO communication), TFLOP/s and MFU (cplm_dist.profiling.throughput),
peak memory and the estimate of cplm_dist.profiling.memory, as a console table, a JSON file (--json) and one
row appended to a CSV (--csv). --trace FILE writes a torch.profiler Chrome trace of one step.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cplm_dist.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.config import Config, batch_layout, load_config
from cplm_dist.errors import UsageError
from cplm_dist.profiling.memory import estimate, stage_estimates

SWEEPABLE = {  # --sweep name -> config override (a value list follows the '=')
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "zero": "train.zero_stage",
    "micro": "train.micro_batch_size",
    "ckpt": "train.activation_checkpointing",
    "copy": "copy.enabled",
    "copy_impl": "copy.impl",
    "chunk": "copy.chunk_size",
    "seq": "data.seq_length",
    "precision": "train.precision",
}


def parser() -> argparse.ArgumentParser:
    p = config_parser(__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: data.seq_length)")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step (global = micro x this x dp)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="clean, timed steps")
    p.add_argument("--breakdown-steps", type=int, default=2, help="instrumented steps for the time breakdown")
    p.add_argument("--trace", help="write a torch.profiler Chrome trace of one step to this file")
    p.add_argument("--json", help="write the result as JSON to this file")
    p.add_argument("--csv", default="runs/profile/profile.csv", help="append one row per run here ('' to skip)")
    p.add_argument("--label", default="", help="a name for this run in the CSV")
    p.add_argument("--sweep", nargs="+", metavar="NAME=V1,V2", help=f"grid over {sorted(SWEEPABLE)}; each point a fresh launch")
    p.add_argument("--nproc", type=int, help="--sweep: processes per point (default: the point's tp x pp)")
    p.add_argument("--out-dir", default="runs/profile", help="--sweep: CSV and plots go here")
    p.add_argument("--copy-overhead", action="store_true", help="copy head on and off, alternating, same shapes")
    p.add_argument("--peer", action="store_true", help="also transformers' LlamaForCausalLM, same shapes, tp=1")
    p.add_argument("--rounds", type=int, default=3, help="--copy-overhead / --peer / --decode: alternations")
    p.add_argument("--decode", action="store_true", help="decoding tokens/s with the KV cache, copy on and off (cplm_dist.profiling.decoding)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8], metavar="B")
    p.add_argument("--decode-prompts", type=int, nargs="+", default=[512, 2048], metavar="T", help="prompt lengths")
    p.add_argument("--new-tokens", type=int, default=64, help="--decode: tokens generated after each prompt")
    p.add_argument("--report", metavar="CSV", help="print a markdown table of a profile CSV and exit")
    return p


# --- one configuration, this launch --------------------------------------------------------------


def setup(cfg: Config, args):
    from cplm_dist.parallel import default_device, init_distributed
    from cplm_dist.profiling.measure import release_freed_memory_on_cpu

    dims = init_distributed(cfg.parallel.tp, pp_size=cfg.parallel.pp)
    device = default_device()
    if device.type == "cpu":
        release_freed_memory_on_cpu()
    seq = args.seq_len or cfg.data.seq_length
    if seq > cfg.model.max_seq_len:
        raise UsageError(f"--seq-len {seq} exceeds model.max_seq_len={cfg.model.max_seq_len}: raise it with model.max_seq_len={seq}")
    cfg.train.global_batch_size = cfg.train.micro_batch_size * args.accumulation * dims.dp_size
    cfg.data.seq_length = seq
    return dims, device, seq, batch_layout(cfg, dims.dp_size)


def build(cfg: Config, dims, device, model=None):
    """Training's own step (cplm_dist.train_step) for `model` (default: the config's CPLM)."""
    from cplm_dist.engine import build_engine
    from cplm_dist.model import build_model
    from cplm_dist.model.pipeline import build_pipeline_model
    from cplm_dist.train_step import TrainStep

    torch.manual_seed(cfg.seed)
    if model is None:
        model = build_pipeline_model(cfg, dims, device=device) if dims.pp_size > 1 else build_model(cfg, device=device)
    engine, optimizer, scheduler = build_engine(model, cfg, dims)
    return TrainStep(engine, optimizer, scheduler, dims, cfg)


def describe(cfg: Config, dims, seq: int, accumulation: int) -> dict:
    from cplm_dist.model.counting import parameter_count

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "date": datetime.date.today().isoformat(), "device": device, "config": cfg.model.name,
        "parameters": parameter_count(cfg)["total"], "copy": f"{cfg.copy.mix}/{cfg.copy.paste}" if cfg.copy.enabled else "off",
        "copy_impl": f"{cfg.copy.impl}/{cfg.copy.chunk_size}" if cfg.copy.impl == "chunked" else cfg.copy.impl,
        "tp": dims.tp_size, "pp": dims.pp_size, "dp": dims.dp_size, "world": dims.world_size, "zero": cfg.train.zero_stage,
        "precision": cfg.train.precision, "micro_batch": cfg.train.micro_batch_size, "accumulation": accumulation,
        "global_batch": cfg.train.global_batch_size, "seq_len": seq, "activation_checkpointing": cfg.train.activation_checkpointing,
    }


def profile_one(cfg: Config, args) -> dict:
    from cplm_dist.model.copy_head import CopyHead
    from cplm_dist.profiling.measure import current_memory_bytes, measure

    dims, device, seq, accumulation = setup(cfg, args)
    baseline = current_memory_bytes(device)
    step = build(cfg, dims, device)
    result = {**describe(cfg, dims, seq, accumulation), "label": args.label}
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


def alternate(engines: dict, cfg: Config, args, dims, device, seq: int) -> dict:
    """Interleave timed steps of several engines on the same shapes; per engine: the median step
    time and the memory it adds (its states, measured when built, plus its step's peak above that)."""
    import statistics
    import time

    from cplm_dist.parallel import synchronize
    from cplm_dist.profiling.measure import PeakMeter, current_memory_bytes, synthetic_batches

    batches = synthetic_batches(cfg, cfg.train.micro_batch_size, seq, device, torch.Generator().manual_seed(0))
    times = {name: [] for name in engines}
    peaks = {name: 0 for name in engines}
    for name, (step, _) in engines.items():
        for _ in range(args.warmup):
            step(batches)
    for _ in range(args.rounds):
        for name, (step, _) in engines.items():
            before = current_memory_bytes(device)
            with PeakMeter(device) as meter:
                for _ in range(args.steps):
                    synchronize(device)
                    start = time.perf_counter()
                    step(batches)
                    synchronize(device)
                    times[name].append(time.perf_counter() - start)
            peaks[name] = max(peaks[name], meter.peak - before)
    out = {}
    tokens = cfg.train.global_batch_size * seq
    for name, (_, static) in engines.items():
        median = statistics.median(times[name])
        out[name] = {"step_time_s": median, "tokens_per_s": tokens / median,
                     "tokens_per_s_per_device": tokens / median / dims.world_size,
                     "memory_gb": (static + peaks[name]) / 1e9}
    return out


def build_measured(make, device):
    from cplm_dist.profiling.measure import current_memory_bytes

    before = current_memory_bytes(device)
    engine = make()
    return engine, current_memory_bytes(device) - before


def copy_overhead(cfg: Config, args) -> dict:
    import copy as copylib

    dims, device, seq, accumulation = setup(cfg, args)
    off = copylib.deepcopy(cfg)
    off.copy.enabled = False
    cfg.copy.enabled = True
    engines = {"copy_on": build_measured(lambda: build(cfg, dims, device), device),
               "copy_off": build_measured(lambda: build(off, dims, device), device)}
    res = alternate(engines, cfg, args, dims, device, seq)
    est_on = estimate(cfg, tp=dims.tp_size, dp=dims.dp_size, micro_batch=cfg.train.micro_batch_size, seq_len=seq)
    est_off = estimate(off, tp=dims.tp_size, dp=dims.dp_size, micro_batch=cfg.train.micro_batch_size, seq_len=seq)
    return {**describe(cfg, dims, seq, accumulation), "label": args.label, "mode": "copy-overhead", **{f"{k}_{m}": v for k, r in res.items() for m, v in r.items()},
            "step_time_ratio": res["copy_on"]["step_time_s"] / res["copy_off"]["step_time_s"],
            "memory_difference_gb": res["copy_on"]["memory_gb"] - res["copy_off"]["memory_gb"],
            "estimated_memory_difference_gb": (est_on.total - est_off.total) / 1e9}


def hf_llama(cfg: Config, device):
    """transformers' LlamaForCausalLM with our shapes (a benchmark extra: pip install transformers)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise UsageError("--peer needs transformers: pip install -e '.[bench]'") from None
    m = cfg.model
    hf_cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                         max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                         tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(hf_cfg).to(device)


class HFAdapter(torch.nn.Module):
    """Gives the Llama model our forward signature, with its own (standard) cross-entropy loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        from cplm_dist.vocab_parallel import TokenLoss

        logits = self.model(input_ids=input_ids).logits
        nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        nll = nll.view_as(labels)
        return TokenLoss(nll, nll.detach(), torch.zeros_like(nll))


def peer(cfg: Config, args) -> dict:
    import copy as copylib

    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1:
        raise UsageError("--peer compares at parallel.tp=1, parallel.pp=1 (transformers' Llama has no tensor or pipeline parallelism)")
    dims, device, seq, accumulation = setup(cfg, args)
    off = copylib.deepcopy(cfg)
    off.copy.enabled = False
    engines = {"ours_copy_on": build_measured(lambda: build(cfg, dims, device), device),
               "ours_copy_off": build_measured(lambda: build(off, dims, device), device),
               "hf_llama": build_measured(lambda: build(off, dims, device, HFAdapter(hf_llama(cfg, device))), device)}
    res = alternate(engines, cfg, args, dims, device, seq)
    return {**describe(cfg, dims, seq, accumulation), "label": args.label, "mode": "peer", **{f"{k}_{m}": v for k, r in res.items() for m, v in r.items()},
            "speedup_copy_off_vs_hf": res["ours_copy_off"]["tokens_per_s"] / res["hf_llama"]["tokens_per_s"],
            "speedup_copy_on_vs_hf": res["ours_copy_on"]["tokens_per_s"] / res["hf_llama"]["tokens_per_s"]}


def decode(cfg: Config, args) -> dict:
    """Decoding tokens/s, copy on and off, in the training precision (tp = 1: one process)."""
    import copy as copylib

    from cplm_dist.model import build_model
    from cplm_dist.profiling.decoding import decode_overhead, markdown

    longest = max(args.decode_prompts) + args.new_tokens
    if longest > cfg.model.max_seq_len:
        raise UsageError(f"--decode: prompt {max(args.decode_prompts)} + --new-tokens {args.new_tokens} exceeds "
                         f"model.max_seq_len={cfg.model.max_seq_len}: add model.max_seq_len={longest} (RoPE extends)")
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1:
        raise UsageError("--decode measures one process: use parallel.tp=1 and parallel.pp=1")
    dims, device, seq, accumulation = setup(cfg, args)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" and device.type == "cuda" else torch.float32
    off = copylib.deepcopy(cfg)
    off.copy.enabled = False
    cfg.copy.enabled = True
    models = {name: build_model(c, device=device, dtype=dtype, compile_layers=False, sequence_parallel=False).eval() for name, c in (("copy_on", cfg), ("copy_off", off))}
    points = [(b, t) for b in args.decode_batches for t in args.decode_prompts]
    rows = decode_overhead(models, cfg.model.vocab_size, points, args.new_tokens, args.rounds, device, seed=cfg.seed)
    print(markdown(rows), flush=True)
    return {**describe(cfg, dims, seq, accumulation), "label": args.label, "mode": "decode", "dtype": str(dtype).removeprefix("torch."), "points": rows}


# --- output --------------------------------------------------------------------------------------


def table(result: dict) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    flat = {}
    for k, v in result.items():  # a nested record (comm_by_collective) one line per entry
        flat.update({f"{k}.{sub}": x for sub, x in v.items()} if isinstance(v, dict) else {k: v})
    width = max(len(k) for k in flat)
    return "\n".join(f"  {k:<{width}}  {fmt(v)}" for k, v in flat.items())


REPORT_COLUMNS = [
    ("label", "run"), ("device", "device"), ("config", "model"), ("copy", "copy"), ("tp", "tp"), ("pp", "pp"), ("dp", "dp"),
    ("zero", "ZeRO"), ("precision", "precision"), ("micro_batch", "micro"), ("seq_len", "seq"),
    ("tokens_per_s_per_device", "tokens/s/device"), ("tflops_per_device", "TFLOP/s/device"), ("mfu", "MFU"),
    ("step_memory_gb", "memory GB"), ("estimated_memory_gb", "estimate GB"), ("estimate_error", "estimate error"),
    ("step_time_ratio", "copy on/off time"), ("memory_difference_gb", "copy memory GB"),
]


def report(path: str) -> str:
    """A markdown table of the runs in a profile CSV (columns a run lacks stay empty)."""
    if not Path(path).is_file():
        raise UsageError(f"--report {path}: no such CSV (tools/cplm_profile.py --csv writes one)")
    rows = list(csv.DictReader(open(path)))

    def cell(row, key):
        v = row.get(key, "")
        try:
            f = float(v)
        except ValueError:
            return v
        if key in ("mfu", "estimate_error"):
            return f"{f:.1%}"
        return f"{f:,.0f}" if abs(f) >= 100 else f"{f:.3g}"

    lines = ["| " + " | ".join(h for _, h in REPORT_COLUMNS) + " |", "|" + "---|" * len(REPORT_COLUMNS)]
    lines += ["| " + " | ".join(cell(r, k) for k, _ in REPORT_COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def append_csv(path: str, result: dict) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    rows = list(csv.DictReader(open(p))) if p.exists() else []
    result = {k: v for k, v in result.items() if not isinstance(v, dict)}  # nested records: the JSON only
    fields = list(dict.fromkeys([*(rows[0].keys() if rows else []), *result]))
    rows.append({k: result.get(k, "") for k in fields})
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, p)


# --- sweeps: each point a fresh launch ------------------------------------------------------------


def parse_sweep(items: list[str]) -> dict[str, list[str]]:
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in SWEEPABLE or not values:
            raise UsageError(f"--sweep {item!r}: use NAME=V1,V2 with NAME one of {sorted(SWEEPABLE)}")
        grid[name] = values.split(",")
    return grid


def sweep_points(args, grid: dict[str, list[str]]) -> tuple[list[tuple[dict, list[str], Config]], list[tuple[dict, str]]]:
    """The grid's points whose config is valid, as (point, overrides, config), and the others as
    (point, the config's one-line reason): a grid may cross settings that exclude each other
    (pp=2 with zero=2), and those points are skipped, not the sweep. All invalid: a UsageError."""
    valid, skipped = [], []
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values))
        overrides = [f"{SWEEPABLE[k]}={v}" for k, v in point.items()]
        if "seq" in point and point["seq"].isdigit():
            overrides.append(f"model.max_seq_len={max(int(point['seq']), 1)}")
        try:
            valid.append((point, overrides, load_config(args.config, args.overrides + overrides)))
        except UsageError as e:
            skipped.append((point, str(e)))
    if not valid:
        point, reason = skipped[0]
        raise UsageError(f"no valid sweep point: {point}: {reason}")
    return valid, skipped


def sweep(args) -> int:
    grid = parse_sweep(args.sweep)
    points, skipped = sweep_points(args, grid)  # every point checked before any launch
    for point, reason in skipped:
        print(f"sweep point {point} skipped: {reason}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "sweep.csv"
    results = []
    for point, overrides, cfg in points:
        nproc = args.nproc or cfg.parallel.tp * cfg.parallel.pp
        with tempfile.TemporaryDirectory() as tmp:
            result_file = Path(tmp) / "point.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--config", args.config, *args.overrides, *overrides,
                   "--warmup", str(args.warmup), "--steps", str(args.steps), "--breakdown-steps", str(args.breakdown_steps),
                   "--accumulation", str(args.accumulation), "--json", str(result_file), "--csv", "",
                   "--label", args.label or " ".join(f"{k}={v}" for k, v in point.items())]
            if args.seq_len:
                cmd += ["--seq-len", str(args.seq_len)]
            if nproc > 1:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd[1:]]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if nproc > 1 else str(os.cpu_count()))}
            print(f"sweep point {point}: {nproc} process(es)", flush=True)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
                raise UsageError(f"sweep point {point} failed (exit {proc.returncode}): {tail[0]}")
            result = {**{f"sweep_{k}": v for k, v in point.items()}, **json.loads(result_file.read_text())}
        results.append(result)
        append_csv(str(csv_path), result)
    plots = plot_sweep(results, grid, out)
    print(f"sweep: {len(results)} points -> {csv_path}" + "".join(f"\n  {p}" for p in plots))
    return 0


def plot_sweep(results: list[dict], grid: dict, out: Path) -> list[Path]:
    """One PNG per swept variable: tokens/s and step memory against it, a line per other setting."""
    from cplm_dist.profiling.plotting import figure, lines

    paths = []
    for var in grid:
        others = [k for k in grid if k != var]
        key = lambda r: ", ".join(f"{k}={r[f'sweep_{k}']}" for k in others) or "all"  # noqa: E731
        speed, memory = {}, {}
        for r in results:
            speed.setdefault(key(r), []).append((r[f"sweep_{var}"], r["tokens_per_s"]))
            memory.setdefault(key(r), []).append((r[f"sweep_{var}"], r["step_memory_gb"]))
        path = out / f"sweep_{var}.png"
        with figure(path, ncols=2, size=(10, 4)) as (ax_t, ax_m):
            lines(ax_t, speed, xlabel=var, ylabel="tokens/s (global)", title=f"throughput vs {var}")
            lines(ax_m, memory, xlabel=var, ylabel="GB above baseline (peak)", title=f"memory vs {var}")
        paths.append(path)
    return paths


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.sweep:
        return sweep(args)
    cfg = load_from_args(args)
    from cplm_dist.parallel import destroy_distributed

    if args.copy_overhead:
        result = copy_overhead(cfg, args)
    elif args.peer:
        result = peer(cfg, args)
    elif args.decode:
        result = decode(cfg, args)
    else:
        result = profile_one(cfg, args)
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
