"""The planner's chosen layout as config: the fields `tools/plan.py --write` sets in a run config
(its other sections and comments kept: config.editing) and the overrides `--dry-run` traces.

    write_run_config(Path("run.yaml"), "cplm-7b", plans[0], seq_len=4096, global_batch=1024, note=...)
"""

from __future__ import annotations

from pathlib import Path

from cplm_dist.config.editing import set_fields, yaml_scalar
from cplm_dist.files import write_text_atomic
from cplm_dist.profiling.planner import Plan

PLAN_NOTE = "# layout from tools/plan.py"  # the line a written config carries (a rewrite replaces it)


def layout_fields(best: Plan, seq_len: int, global_batch: int) -> dict[tuple[str, str], object]:
    """{(section, field): value} of the chosen layout: what --write sets and --dry-run traces."""
    return {("parallel", "tp"): best.tp, ("parallel", "pp"): best.pp, ("parallel", "cp"): best.cp,
            ("parallel", "sequence_parallel"): best.sequence_parallel,
            ("data", "seq_length"): seq_len, ("train", "micro_batch_size"): best.micro_batch,
            ("train", "global_batch_size"): global_batch, ("train", "zero_stage"): best.zero_stage,
            ("train", "activation_checkpointing"): best.activation_checkpointing,
            **({("parallel", "pp_schedule"): best.pp_schedule} if best.pp > 1 else {}),
            **({("parallel", "ep"): best.ep, ("parallel", "expert_tp"): best.expert_tp}  # a sparse model's experts
               if best.ep > 1 or best.expert_tp != best.tp else {})}


def write_run_config(path: Path, source: str, best: Plan, seq_len: int, global_batch: int, note: str) -> None:
    """Set the layout fields of a run config (from `source`: a YAML file, or a shipped name that
    becomes its base) and write it to `path`, the plan's line under the first comment line."""
    src = Path(source)
    text = src.read_text() if src.is_file() else f"base: {source}\n"
    text = set_fields(text, layout_fields(best, seq_len, global_batch))
    lines = [line for line in text.splitlines() if not line.startswith(PLAN_NOTE)]
    at = 1 if lines and lines[0].startswith("#") else 0
    lines.insert(at, note)
    write_text_atomic(path, "\n".join(lines) + "\n")


def layout_overrides(best: Plan, seq_len: int, global_batch: int) -> list[str]:
    """The chosen layout as config overrides (what --write sets)."""
    return [f"{section}.{key}={yaml_scalar(value)}" for (section, key), value in layout_fields(best, seq_len, global_batch).items()]
