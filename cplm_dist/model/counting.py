"""Exact parameter counts from a config alone (no allocation), for any size up to 70B and beyond:
the one place they are written. The training log, the FLOP count (`matmul_parameters`) and the
memory estimator (`parameters_per_device`) all read them from here.

A sparse model (model.moe) has layers that differ in their MLP slot: each layer is counted from
its own shapes (cplm_dist.model.layer_shapes). Its `parameter_count` is every parameter; a token
only meets the router, its top_k experts and the shared expert of a sparse layer, so
`active_parameters` and the FLOP count (`matmul_parameters`, hence MFU) count top_k of the E experts.

A test ties `parameter_count` to the real module at tiny size, so the figures for the shipped
large configs can be trusted without building them.
"""

from __future__ import annotations

import copy
import functools
import math

from cplm_dist.config import Config
from cplm_dist.config.backbones import backbone
from cplm_dist.config.sparse import expert_tp
from cplm_dist.model.layer_shapes import ParameterShape, layer_kinds, model_layer_shapes, norm_shapes
from cplm_dist.model.loss import padded_vocab_size
from cplm_dist.model.mixes import MIXES


def per_model(fn):
    """Remember `fn(cfg, ...)` per model, copy head and tp / ep / expert_tp layout: a sparse model's
    layers list every expert (12k entries for a 48-layer model of 128 experts), and the planner
    asks for the same counts thousands of times. Returns a copy of a list or dict result."""
    cache: dict = {}

    @functools.wraps(fn)
    def remembered(cfg: Config, *args, **kwargs):
        p = cfg.parallel
        key = (repr(cfg.model), repr(cfg.copy), p.tp, p.ep, p.expert_tp, args, tuple(sorted(kwargs.items())))
        if key not in cache:
            if len(cache) > 4096:
                cache.clear()
            cache[key] = fn(cfg, *args, **kwargs)
        found = cache[key]
        return copy.copy(found) if isinstance(found, (list, dict)) else found

    return remembered


def _all_layers(cfg: Config, layers: int | None = None) -> list[ParameterShape]:
    """Every parameter tensor of the model's layers (or of `layers` of them: model_layer_shapes), in
    module order: each layer's own shapes (cplm_dist.model.layer_shapes: norm, QKV, the qk-norm
    slot, attention out, norm, MLP fc1 and fc2 or the sparse slot, biases where the backbone has
    them), so whatever slot a layer gains is counted here as it is built."""
    return [s for shapes in model_layer_shapes(cfg.model, layers) for s in shapes]


def _layers_sum(cfg: Config, value, layers: int | None = None, keep=lambda s: True) -> float:
    """The sum of value(s) over the layers' tensors s that `keep` keeps, by kind of layer (at most
    two): the planner asks for it for every candidate layout."""
    return sum(count * sum(value(s) for s in kind if keep(s)) for kind, count in layer_kinds(cfg.model, layers))


def _active_numel(s: ParameterShape, cfg: Config) -> float:
    """What of a tensor one token uses: a routed expert's top_k / E (each token meets top_k of the
    E equal experts), everything else whole."""
    e = cfg.model.moe
    return s.numel * e.top_k / e.num_experts if s.expert is not None else s.numel


def _layer_matrices(cfg: Config, layers: int | None = None) -> int:
    """Weight-matrix parameters one token multiplies in the layers (QKV, attention out, MLP fc1 and
    fc2; in a sparse layer the router, top_k experts and the shared expert)."""
    return round(_layers_sum(cfg, lambda s: _active_numel(s, cfg), layers, lambda s: s.matrix))


def _norm_tensors(cfg: Config) -> list[int]:
    """The final norm's tensors (the backbone's norm: a weight, and LayerNorm's bias)."""
    return [s.numel for s in norm_shapes(cfg.model)]


def _positions(cfg: Config) -> int:
    """Learned absolute positions (replicated on every tp rank); none with rotary positions."""
    return cfg.model.max_seq_len * cfg.model.hidden_size if backbone(cfg.model).positions == "learned" else 0


def _copy_mix_tensors(cfg: Config) -> list[tuple[int, bool]]:
    """(elements, multiplies the hidden state) of each parameter the mix adds to the copy head."""
    c = cfg.copy
    return [(math.prod(shape), matmul) for _, shape, matmul in MIXES[c.mix].own_parameters(cfg.model.hidden_size, c.num_heads, c.head_dim)]


def copy_head_parameters(cfg: Config) -> tuple[int, int]:
    """(matrix parameters: q, k and what of the mix multiplies h (a gate's weight); the others: a
    gate's bias, the sentinel keys)."""
    c, D = cfg.copy, cfg.model.hidden_size
    if not c.enabled:
        return 0, 0
    own = _copy_mix_tensors(cfg)
    return 2 * D * c.num_heads * c.head_dim + sum(n for n, matmul in own if matmul), sum(n for n, matmul in own if not matmul)


@per_model
def parameter_count(cfg: Config, *, padded: bool = False) -> dict[str, int]:
    """Parameters by part, and their total, over all tp ranks (each counted once).

    padded=True counts Megatron's vocabulary padding rows too (what the module holds at parallel.tp).
    """
    m = cfg.model
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tp) if padded else m.vocab_size
    D = m.hidden_size
    parts = {
        "embedding": vocab * D,
        "positions": _positions(cfg),
        "layers": _layers_sum(cfg, lambda s: s.numel),
        "final_norm": sum(_norm_tensors(cfg)),
        "lm_head": 0 if m.tie_embeddings else vocab * D,
        "copy_head": sum(copy_head_parameters(cfg)),
    }
    parts["total"] = sum(parts.values())
    return parts


@per_model
def active_parameters(cfg: Config) -> int:
    """Parameters one token uses (parameter_count's total for a dense model): a sparse layer's
    router, top_k of its E experts and its shared expert, and everything outside the experts."""
    idle = _layers_sum(cfg, lambda s: s.numel - _active_numel(s, cfg), keep=lambda s: s.expert is not None)
    return parameter_count(cfg)["total"] - round(idle)


@per_model
def parameters_per_device(cfg: Config, tp: int) -> float:
    """Parameters one tp rank holds (before ZeRO-3 sharding), padded vocabulary included: the
    tp-split matrices / tp, plus what every rank replicates (norms, the copy head); a sparse
    layer's experts split over parallel.expert_tp and, whole experts, over parallel.ep."""
    m = cfg.model
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    split = _layers_sum(cfg, lambda s: s.numel, keep=lambda s: s.split is not None and s.expert is None)
    split += vocab * m.hidden_size * (1 if m.tie_embeddings else 2)
    experts = _layers_sum(cfg, lambda s: s.numel / (expert_tp(cfg) if s.split is not None else 1),
                          keep=lambda s: s.expert is not None)
    return split / tp + replicated_parameters(cfg) + experts / cfg.parallel.ep


@per_model
def replicated_parameters(cfg: Config) -> int:
    """Parameters every tp rank holds whole: the norms, the copy head, a sparse layer's router and
    shared-expert gate, and where the backbone has them the row-parallel linears' biases and
    learned positions (under sequence parallelism, the ones whose gradients are summed over tp)."""
    layers = _layers_sum(cfg, lambda s: s.numel, keep=lambda s: s.split is None)
    return layers + sum(_norm_tensors(cfg)) + _positions(cfg) + sum(copy_head_parameters(cfg))


@per_model
def matmul_parameters(cfg: Config, *, layers: int | None = None, heads: bool = True) -> int:
    """Parameters that multiply an activation once per token (docs/performance.md): every weight
    matrix of `layers` transformer layers (default all; a sparse layer's router, top_k experts and
    shared expert) and, with `heads`, the LM head (V x D, tied or not) and the copy head's q, k and
    gate; not the embedding lookup, the norms or biases."""
    m = cfg.model
    return _layer_matrices(cfg, layers) + (m.vocab_size * m.hidden_size + copy_head_parameters(cfg)[0] if heads else 0)


@per_model
def tensor_sizes_per_device(cfg: Config, tp: int, *, layers: int | None = None, first: bool = True,
                            last: bool = True) -> list[int]:
    """Elements of each parameter tensor one tp rank holds, in module order (they sum to
    `parameters_per_device` for the whole model): what ZeRO-3's persistence threshold is applied
    to, tensor by tensor. A pipeline stage (cplm_dist.model.parallel.stages.stage_tensor_sizes) holds
    `layers` transformer layers, the embedding if `first`, and if `last` the final norm, LM head
    and copy head, and under tied embeddings (not first) the embedding's shard too."""
    m, c = cfg.model, cfg.copy
    D = m.hidden_size
    vocab_rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    sizes = [vocab_rows * D] + ([_positions(cfg)] if _positions(cfg) else []) if first else []
    sizes += [_local_size(s, cfg, tp) for s in _all_layers(cfg, layers) if _held(s, cfg)]
    if last:
        sizes += [vocab_rows * D] if m.tie_embeddings and not first else []
        sizes += _norm_tensors(cfg) + ([] if m.tie_embeddings else [vocab_rows * D])
        if c.enabled:
            width = c.num_heads * c.head_dim
            sizes += [width * D, width * D] + [n for n, _ in _copy_mix_tensors(cfg)]
    return sizes


@per_model
def summed_over_tp(cfg: Config, grad_sum: str, layers: int | None = None) -> int:
    """Elements of the replicated layer tensors whose gradients are summed over tp when `grad_sum`
    (layer_shapes.ALWAYS, UNDER_SEQUENCE_PARALLEL) says, in `layers` layers (default all)."""
    return sum(s.numel for s in _all_layers(cfg, layers) if s.grad_sum == grad_sum)


def _held(s: ParameterShape, cfg: Config) -> bool:
    """One rank holds E/ep of a sparse layer's experts (their local ids 0 .. E/ep - 1: the same shapes)."""
    return s.expert is None or s.expert < cfg.model.moe.num_experts // cfg.parallel.ep


def _local_size(s: ParameterShape, cfg: Config, tp: int) -> int:
    """Elements of `s` one rank holds: split over tp, an expert's over parallel.expert_tp."""
    if s.split is None:
        return s.numel
    return s.numel // (expert_tp(cfg) if s.expert is not None else tp)
