"""Runs paired by seed: an ablation's gain is each seed's variant run minus the same seed's
copy-off run (same data order and initial weights but for the copy head), so the seeds' spread
in the baseline cancels. The plain ablation's report, its sparse axis and the retention grid read
it; `won` counts the seeds a gain won and `spread` writes a set of differences as mean [min, max]
with its 90% t-interval.
"""

from __future__ import annotations

import statistics

MARGIN = 0.01  # a difference smaller than this (nats of loss, absolute accuracy) counts as a tie, not a win


def paired_differences(runs: list[dict], size: str, variant: str, metric, key: str = "variant",
                       reference: str = "off") -> list[float]:
    """metric(variant run) - metric(reference run) for every seed that has both; `key` names the
    runs' field the variant is in (the retention grid pairs arms against its reference arm)."""
    by = {(r["size"], r[key], r["seed"]): r for r in runs}
    return [metric(r) - metric(by[(size, reference, seed)]) for (sz, v, seed), r in by.items()
            if (sz, v) == (size, variant) and (size, reference, seed) in by]


def won(metric: str, differences: list[float]) -> int:
    """How many paired differences won: a valid loss lower by more than MARGIN nats, any other
    figure (a suite score) higher by more than MARGIN."""
    return sum(x < -MARGIN for x in differences) if metric == "valid loss" else sum(x > MARGIN for x in differences)


T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}  # t(0.95, df)


def t_interval(values: list[float]) -> tuple[float, float] | None:
    """The 90% Student-t interval of the mean of paired differences (None for fewer than 2): with 3
    seeds it is wide (t = 2.92), which is the honest width of 3 seeds."""
    if len(values) < 2:
        return None
    half = T90.get(len(values) - 1, 1.645) * statistics.stdev(values) / len(values) ** 0.5
    return statistics.mean(values) - half, statistics.mean(values) + half


def spread(values: list[float]) -> str:
    """mean [min, max], and the 90% t-interval of the mean."""
    t = t_interval(values)
    return (f"{statistics.mean(values):+.3f} [{min(values):+.3f}, {max(values):+.3f}]"
            + (f", 90% t [{t[0]:+.3f}, {t[1]:+.3f}]" if t else ""))
