"""What a step's sparse layers did, for the logs: the auxiliary losses each router computed (its
load-balancing and z-losses, the coefficient divided out) and each layer's routed tokens per
expert, summed over the step's micro-batches on this rank.

megatron-core's router reports its losses to a tracker of its own; cplm_dist.megatron_compat
points those calls here (`record_aux_loss`). The sparse layers add their routing counts
(`SparseMLP.load`, cplm_dist.model.moe). `step_figures` reduces both over the step's ranks and
resets them: per layer the mean auxiliary losses, the tokens per expert, max/mean load, the
dropped share (capacity) and the router's entropy.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from cplm_dist.model.moe_recompute import recomputing

# name -> layer number (1-based, megatron's) -> [sum of values, count]
_AUX: dict[str, dict[int, list]] = defaultdict(dict)


def record_aux_loss(name: str, loss: torch.Tensor, layer_number: int | None, num_layers: int, **_groups) -> None:
    """megatron's save_to_aux_losses_tracker signature: one value of one layer's auxiliary loss
    (coefficient divided out), detached; averaged over the calls when a step is reported."""
    if layer_number is None or recomputing():  # a checkpointed layer's recomputation reports nothing twice
        return
    entry = _AUX[name].setdefault(layer_number, [torch.zeros((), dtype=torch.float64), 0])
    entry[0] += loss.detach().double().cpu()
    entry[1] += 1


def aux_losses(reset: bool = True) -> dict[str, dict[int, float]]:
    """{loss name: {layer: mean value on this rank}} since the last reset."""
    out = {name: {layer: float(s) / max(1, n) for layer, (s, n) in layers.items()} for name, layers in _AUX.items()}
    if reset:
        _AUX.clear()
    return out


def step_figures(layers: list, group=None) -> dict[str, float]:
    """The step's figures of these sparse layers (cplm_dist.model.moe.SparseMLP), reduced over
    `group` (the stage's tp x cp x dp ranks; None: this rank alone), their counts reset:
    per layer `moe/L<i>/<figure>` and over layers `moe/<figure>` (mean): aux_loss (each
    auxiliary loss by name, coefficient divided out), max_load (the busiest expert's tokens over
    the mean), dropped (share of routed assignments dropped by capacity), entropy (the router's,
    nats), and tokens_per_expert (a list) per layer. One all-reduce."""
    import torch.distributed as dist

    if not layers:
        return {}
    losses = aux_losses()
    names = sorted(losses)
    rows = []
    for layer in layers:
        number = layer.router.layer_number
        rows.append(torch.cat([layer.load.cpu(), layer.routing_sums.cpu(),
                               torch.tensor([losses[n].get(number, 0.0) for n in names], dtype=torch.float64)]))
        layer.load.zero_()
        layer.routing_sums.zero_()
    packed = torch.stack(rows)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        device = layers[0].load.device
        packed = packed.to(device)
        dist.all_reduce(packed, group=group)
        packed = packed.cpu()
        packed[:, -len(names) or packed.shape[1]:] /= dist.get_world_size(group) if names else 1
    out: dict[str, float] = {}
    for layer, row in zip(layers, packed):
        experts = layer.num_experts
        load, (tokens, dropped, entropy) = row[:experts], row[experts:experts + 3].tolist()
        key = f"moe/L{layer.router.layer_number - 1}"
        if tokens > 0:
            out[f"{key}/max_load"] = float(load.max() / load.mean().clamp_min(1e-12))
            out[f"{key}/dropped"] = dropped / (tokens * layer.top_k)
            out[f"{key}/entropy"] = entropy / tokens
            out[f"{key}/tokens_per_expert"] = [int(v) for v in load.tolist()]
        for n, value in zip(names, row[experts + 3:].tolist()):
            out[f"{key}/{n}"] = value
    for figure in ["max_load", "dropped", "entropy", *names]:
        values = [v for k, v in out.items() if k.endswith(f"/{figure}") and k.count("/") == 2]
        if values:
            out[f"moe/{figure}"] = sum(values) / len(values)
    return out
