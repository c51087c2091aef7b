"""The profiler's records: the console table of one result, one CSV row per run (appended
atomically, columns growing as runs add fields), and a markdown table of such a CSV."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from cplm_dist.errors import UsageError


def table(result: dict) -> str:
    """One line per field (a nested record, such as comm_by_collective, one line per entry)."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    flat = {}
    for k, v in result.items():
        flat.update({f"{k}.{sub}": x for sub, x in v.items()} if isinstance(v, dict) else {k: v})
    width = max(len(k) for k in flat)
    return "\n".join(f"  {k:<{width}}  {fmt(v)}" for k, v in flat.items())


REPORT_COLUMNS = [
    ("label", "run"), ("device", "device"), ("config", "model"), ("copy", "copy"), ("optimizer", "optimizer"), ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("dp", "dp"),
    ("zero", "ZeRO"), ("precision", "precision"), ("micro_batch", "micro"), ("seq_len", "seq"),
    ("tokens_per_s_per_device", "tokens/s/device"), ("tflops_per_device", "TFLOP/s/device"), ("mfu", "MFU"),
    ("step_memory_gb", "memory GB"), ("estimated_memory_gb", "estimate GB"), ("estimate_error", "estimate error"),
    ("optimizer_share", "optimizer share"), ("step_time_ratio", "copy on/off time"), ("memory_difference_gb", "copy memory GB"),
]


def report(path: str) -> str:
    """A markdown table of the runs in a profile CSV (columns a run lacks stay empty)."""
    if not Path(path).is_file():
        raise UsageError(f"--report {path}: no such CSV (tools/cplm_profile.py --csv writes one)")
    with open(path) as f:
        rows = list(csv.DictReader(f))

    def cell(row, key):
        v = row.get(key, "")
        try:
            f = float(v)
        except ValueError:
            return v
        if key in ("mfu", "estimate_error", "optimizer_share"):
            return f"{f:.1%}"
        return f"{f:,.0f}" if abs(f) >= 100 else f"{f:.3g}"

    lines = ["| " + " | ".join(h for _, h in REPORT_COLUMNS) + " |", "|" + "---|" * len(REPORT_COLUMNS)]
    lines += ["| " + " | ".join(cell(r, k) for k, _ in REPORT_COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def append_csv(path: str | Path, result: dict) -> None:
    """Append `result` (its flat fields: nested records go to the JSON only) as a row of the CSV
    at `path` ('' : none), rewritten atomically with the union of the columns."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    if p.exists():
        with open(p) as f:
            rows = list(csv.DictReader(f))
    result = {k: v for k, v in result.items() if not isinstance(v, dict)}
    fields = list(dict.fromkeys([*(rows[0].keys() if rows else []), *result]))
    rows.append({k: result.get(k, "") for k in fields})
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, p)
