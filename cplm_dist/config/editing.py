"""A run config's YAML edited as text, so that what a person wrote stays: each (section, key) set
to a value in place, comments and order kept; a missing key goes under its section, a missing
section at the end (tools/plan.py --write sets a layout this way).

    text = set_fields(Path("configs/runs/cplm-7b.yaml").read_text(), {("parallel", "tp"): 4})
"""

from __future__ import annotations

import re


def set_fields(text: str, fields: dict[tuple[str, str], object]) -> str:
    """`text` (a run config's YAML) with each (section, key) set to its value, as text: comments and
    order kept; a missing key goes under its section, a missing section at the end."""
    lines, section, done = text.splitlines(), None, set()
    out = []
    for line in lines:
        top = re.match(r"^(\w+):\s*(#.*)?$", line)
        if top:
            if section is not None:
                out += _missing(fields, section, done)
            section = top.group(1)
        kv = re.match(r"^(  )(\w+):(\s*)([^#]*?)(\s*#.*)?$", line)
        if kv and section is not None and (section, kv.group(2)) in fields:
            key = (section, kv.group(2))
            line = f"  {kv.group(2)}: {yaml_scalar(fields[key])}{kv.group(5) or ''}"
            done.add(key)
        out.append(line)
    if section is not None:
        out += _missing(fields, section, done)
    for sec in dict.fromkeys(s for s, _ in fields):
        rest = _missing(fields, sec, done)
        if rest:
            out += [f"{sec}:", *rest]
    return "\n".join(out) + "\n"


def _missing(fields: dict, section: str, done: set) -> list[str]:
    keys = [k for (s, k) in fields if s == section and (s, k) not in done]
    done.update((section, k) for k in keys)
    return [f"  {k}: {yaml_scalar(fields[(section, k)])}" for k in keys]


def yaml_scalar(value) -> str:
    """A scalar as YAML writes it (booleans lower case)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)
