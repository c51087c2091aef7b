"""A sparse model's routing in the run's log: the `moe` figures of each train record, over the
steps since the last record, built from each step's `StepResult.moe`
(cplm_dist.model.moe_stats.step_figures) the way cplm_dist.training.run_log builds the losses.

    "moe": {"max_load": .., "dropped": .., "entropy": .., "load_balancing_loss": .., ...,   # means over the sparse layers
            "L0": {"max_load": .., "dropped": .., "entropy": .., "load_balancing_loss": ..,
                   "tokens_per_expert": [n_0, .., n_{E-1}]}, "L1": {..}, ..}

Per layer (`L<i>`, i the 0-based layer index), over the window's good steps (the steps whose loss
counts in the record): `tokens_per_expert` summed (the token assignments each expert received
and kept, over every rank; they add up to steps x tokens a step x top_k, less the dropped ones);
`max_load` (the busiest expert's tokens over the mean), `dropped` (the share of assignments
dropped by model.moe.capacity_factor), `entropy` (the router's, nats, at most log E) and each
auxiliary loss by megatron's name (coefficient divided out) averaged over the steps. The top-level
figures are their means over the sparse layers. None of it is part of `loss`, `lm_loss` or
`copy_share`: the auxiliary losses reach only the gradient (cplm_dist.model.moe).

Under pipeline parallelism a stage's routers are its own: at each record every rank sends its
window over the pp group (one all_gather_object per record, not per step), so rank 0 writes
every stage's layers.
"""

from __future__ import annotations

import torch.distributed as dist

# a layer's figures that are means over the window; tokens_per_expert is summed, the auxiliary losses named by megatron
MEANS = ("max_load", "dropped", "entropy")


class MoEWindow:
    """Every rank keeps one (run_log's window of the sparse layers it holds); `record` is collective over pp."""

    def __init__(self, pp_group=None):
        self.pp_group = pp_group
        self.layers: dict[str, dict] = {}  # "L<i>" -> figure -> summed list, or (sum, steps)

    def add(self, figures: dict) -> None:
        """One step's StepResult.moe: its per-layer figures (`moe/L<i>/<figure>`); the means over a
        stage's layers that step_figures adds are left out, recomputed over every stage's layers."""
        for key, value in figures.items():
            parts = key.split("/")
            if len(parts) != 3:
                continue
            slot = self.layers.setdefault(parts[1], {})
            if isinstance(value, list):
                old = slot.get(parts[2])
                slot[parts[2]] = list(value) if old is None else [a + b for a, b in zip(old, value)]
            else:
                total, steps = slot.get(parts[2], (0.0, 0))
                slot[parts[2]] = (total + float(value), steps + 1)

    def record(self) -> dict:
        """The window's `moe` figures (every stage's layers; every rank calls this at a record), then a new window."""
        layers, self.layers = self.layers, {}
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            stages = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, layers, group=self.pp_group)
            layers = {name: figures for stage in stages for name, figures in stage.items()}
        per_layer = {}
        for name in sorted(layers, key=lambda n: int(n[1:])):
            per_layer[name] = {f: v if isinstance(v, list) else v[0] / v[1] for f, v in sorted(layers[name].items())}
        out = {}
        for figure in sorted({f for figures in per_layer.values() for f, v in figures.items() if not isinstance(v, list)},
                             key=lambda f: (f not in MEANS, MEANS.index(f) if f in MEANS else 0, f)):
            values = [figures[figure] for figures in per_layer.values() if figure in figures]
            out[figure] = sum(values) / len(values)
        return {**out, **per_layer}


def console(record: dict) -> str:
    """The console line's short figure: the mean busiest-expert load, and the dropped share when any."""
    if "max_load" not in record:
        return ""
    dropped = record.get("dropped", 0.0)
    return f" | moe max/mean {record['max_load']:.2f}" + (f", dropped {dropped:.1%}" if dropped > 0 else "")
