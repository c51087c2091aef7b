"""Whether the copy head's FlexAttention path has run on a GPU with this torch: the record that
`tools/bench_copy_head.py --record-flex` (run by tools/gpu_check.sh) writes when the fused kernels,
forward and backward, matched the dense path on a CUDA device. Until such a record exists for the
installed torch (major.minor), copy.impl=auto trains on the chunked path on CUDA too: the path the
GPU figures were measured with (docs/copy_head.md, "Which path runs").

The record is `flex_gpu_record.json` beside this file (commit it once a GPU check wrote it);
CPLM_FLEX_RECORD names another file (an empty value: none, so auto stays chunked).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from cplm_dist.files import write_text_atomic

RECORD = Path(__file__).resolve().parent / "flex_gpu_record.json"
ENV = "CPLM_FLEX_RECORD"


def record_path() -> Path | None:
    value = os.environ.get(ENV)
    if value is None:
        return RECORD
    return Path(value) if value else None


def torch_minor(version: str = torch.__version__) -> str:
    """"2.9" of "2.9.1+cu128": the version a record holds for."""
    return ".".join(version.split("+")[0].split(".")[:2])


def read_record(path: Path | None = None) -> dict | None:
    """The record (device, torch, date, the check's tolerance and worst differences) when it is
    for the installed torch's major.minor; else None (none there, unreadable, or another torch)."""
    path = record_path() if path is None else path
    if path is None or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("torch") != torch_minor():
        return None
    return record


def write_record(rows: list[dict], tolerance: float, device_name: str, path: Path | None = None) -> Path:
    """Write the record from a passing check's flex rows (tools/bench_copy_head.py: seq_len,
    max_abs_diff_lse, max_rel_diff_grad) on the GPU `device_name`: which GPU, torch, when, and the
    differences seen."""
    import datetime

    path = (record_path() or RECORD) if path is None else path
    record = {"torch": torch_minor(), "torch_version": torch.__version__, "device": device_name,
              "date": datetime.date.today().isoformat(), "tolerance": tolerance,
              "seq_lens": [r["seq_len"] for r in rows],
              "max_abs_diff_lse": max(r["max_abs_diff_lse"] for r in rows),
              "max_rel_diff_grad": max(r["max_rel_diff_grad"] for r in rows),
              "by": "tools/bench_copy_head.py --impls ... flex --check TOL --record-flex (tools/gpu_check.sh)"}
    write_text_atomic(path, json.dumps(record, indent=2) + "\n")
    return path
