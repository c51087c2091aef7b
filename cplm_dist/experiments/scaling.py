"""Scaling ladders for copy on / off: shapes for a parameter target, a token budget, and the fit
of loss against compute (tools/scaling.py drives the runs).

    shape = shape_for(base, 5e6, aspect=32)            # model.* overrides hitting 5M parameters
    tokens = token_budget(params, tokens_per_parameter=20)
    fit = fit_power_law(compute, loss)                  # L(C) = E + A C^-alpha
    fits = bootstrap(points, seeds)                     # intervals over seeds

Shapes: depth L and width D from a fixed aspect ratio D / L, heads of `head_dim` (D a multiple of
it), the MLP width the backbone's rule (cplm_dist.config.backbones: 4 D for a GELU MLP; 8/3 D rounded
up to a multiple of 64 for SwiGLU, its usual), kv heads = heads. Among the (L, D) whose exact parameter count
(cplm_dist.model.counting) is within `tolerance` of the target, the one closest to the aspect
ratio; else the closest count.

Compute is training FLOPs by the stack's convention (cplm_dist.training.throughput:
flops_per_token x tokens, LM head and attention included), so fits and the profiler's MFU speak
of the same FLOPs.

The fit minimises the squared error of log L over (E, A, alpha): for a fixed E the problem is a
line in log-log space (log(L - E) = log A - alpha log C, solved exactly), and E is searched on
a grid below the smallest loss, refined around the best point. Extrapolation beyond the largest
measured compute is exactly that: the report marks it so.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import numpy as np

from cplm_dist.config import Config, apply_overrides, from_dict, to_dict
from cplm_dist.config.backbones import BACKBONES
from cplm_dist.model.counting import parameter_count
from cplm_dist.training.throughput import flops_per_token


def shape_fields(arch: str, layers: int, hidden: int, head_dim: int) -> dict[str, int]:
    """model.* of a ladder point: heads of head_dim, kv heads = heads, the backbone's MLP width rule.
    model.head_dim is set too: a base config's own (Qwen3's 128, or the hidden / heads it was
    built with) would otherwise stay while the width changes."""
    heads = hidden // head_dim
    return {"num_layers": layers, "hidden_size": hidden, "num_heads": heads, "num_kv_heads": heads, "head_dim": head_dim,
            "ffn_hidden_size": BACKBONES[arch].mlp_width(hidden)}


def with_overrides(base: Config, overrides: list[str]) -> Config:
    """`base` with dotted overrides (not validated: shapes are checked when a run starts)."""
    return from_dict(apply_overrides(to_dict(base), overrides))


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    parameters: int
    overrides: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.parameters / 1e6:.2f}M" if self.parameters < 1e9 else f"{self.parameters / 1e9:.2f}B"


def shape_for(base: Config, target: float, *, aspect: float = 32.0, head_dim: int = 64, tolerance: float = 0.1,
              max_layers: int = 128) -> Shape:
    """The (layers, hidden) of the backbone in `base` whose parameter count is nearest `target`
    within `tolerance` and whose D / L is nearest `aspect` (module docstring)."""
    arch = base.model.arch
    candidates = []
    for layers in range(1, max_layers + 1):
        ideal = aspect * layers
        here = []
        for hidden in {max(head_dim, head_dim * round(ideal / head_dim)), head_dim * math.floor(ideal / head_dim),
                       head_dim * math.ceil(ideal / head_dim), head_dim * (math.ceil(ideal / head_dim) + 1)}:
            if hidden < head_dim:
                continue
            fields = shape_fields(arch, layers, hidden, head_dim)
            n = parameter_count(dataclasses.replace(base, model=dataclasses.replace(base.model, **fields)))["total"]
            overrides = tuple(f"model.{k}={v}" for k, v in fields.items())
            here.append((abs(math.log(n / target)), abs(math.log(hidden / ideal)), Shape(layers, hidden, n, overrides)))
        candidates += here
        # counts only grow with depth (the widths tried grow with it): once the smallest here is past
        # the tolerance and farther than the closest so far, no deeper shape can be chosen
        smallest = min(here, key=lambda c: c[2].parameters, default=None)
        if smallest and smallest[2].parameters > target * (1 + tolerance) and smallest[0] > min(c[0] for c in candidates[:-len(here)] or here):
            break
    inside = [c for c in candidates if c[0] <= math.log1p(tolerance)]
    best = min(inside, key=lambda c: (c[1], c[0])) if inside else min(candidates, key=lambda c: c[0])
    return best[2]


def token_budget(parameters: int, tokens_per_parameter: float) -> int:
    return int(round(parameters * tokens_per_parameter))


def training_flops(cfg: Config, tokens: int, seq_len: int) -> float:
    return flops_per_token(cfg, seq_len) * tokens


@dataclass(frozen=True)
class PowerLaw:
    """L(C) = E + A C^-alpha."""

    E: float
    A: float
    alpha: float
    rms_log_error: float

    def __call__(self, compute: float) -> float:
        return self.E + self.A * compute ** -self.alpha


def _fit_for_e(log_c: np.ndarray, loss: np.ndarray, e: float) -> tuple[float, float, float]:
    """(log A, alpha, rms error of log L) of the line log(L - E) = log A - alpha log C."""
    y = np.log(loss - e)
    slope, intercept = np.polyfit(log_c, y, 1)
    pred = e + np.exp(intercept + slope * log_c)
    return intercept, -slope, float(np.sqrt(np.mean((np.log(loss) - np.log(pred)) ** 2)))


def fit_power_law(compute, loss, *, grid: int = 60) -> PowerLaw:
    """Least squares in log space (module docstring); at least 3 points of distinct compute."""
    c, l_ = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    if len(set(c.tolist())) < 3:
        raise ValueError(f"a power law with an offset needs 3 or more distinct compute values, got {sorted(set(c.tolist()))}")
    log_c, top = np.log(c), float(l_.min())
    best = None
    lo, hi = 0.0, top * (1 - 1e-6)
    for _ in range(5):  # a grid, then finer grids around its best point
        for e in np.linspace(lo, hi, grid):
            log_a, alpha, err = _fit_for_e(log_c, l_, float(e))
            if best is None or err < best[3]:
                best = (float(e), math.exp(log_a), alpha, err)
        step = (hi - lo) / grid
        lo, hi = max(0.0, best[0] - 2 * step), min(top * (1 - 1e-6), best[0] + 2 * step)
    return PowerLaw(best[0], best[1], float(best[2]), best[3])


def bootstrap(points: list[dict], *, samples: int = 200, seed: int = 0) -> list[PowerLaw]:
    """Fits of resampled points: each compute level keeps its size and draws its seeds' losses
    with replacement (points: dicts with "compute", "loss"); with one seed a point is kept as is."""
    rng = random.Random(seed)
    by_compute: dict[float, list[float]] = {}
    for p in points:
        by_compute.setdefault(p["compute"], []).append(p["loss"])
    fits = []
    for _ in range(samples):
        c, l_ = [], []
        for compute, losses in by_compute.items():
            for _ in losses:
                c.append(compute)
                l_.append(rng.choice(losses))
        fits.append(fit_power_law(c, l_))
    return fits


def interval(values: list[float], level: float = 0.9) -> tuple[float, float]:
    """The central `level` interval of `values` (percentiles)."""
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)
