"""Runs paired by seed: an ablation's gain is each seed's variant run minus the same seed's
copy-off run (same data order and initial weights but for the copy head), so the seeds' spread
in the baseline cancels. The plain ablation's report and its sparse axis both read it.
"""

from __future__ import annotations


def paired_differences(runs: list[dict], size: str, variant: str, metric) -> list[float]:
    """metric(variant run) - metric(copy-off run) for every seed that has both."""
    by = {(r["size"], r["variant"], r["seed"]): r for r in runs}
    return [metric(r) - metric(by[(size, "off", seed)]) for (sz, v, seed), r in by.items()
            if (sz, v) == (size, variant) and (size, "off", seed) in by]
