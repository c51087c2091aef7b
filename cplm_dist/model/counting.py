"""Exact parameter counts from a config alone (no allocation), for any size up to 70B and beyond:
the one place they are written. The training log, the FLOP count (`matmul_parameters`) and the
memory estimator (`parameters_per_device`) all read them from here.

A test ties `parameter_count` to the real module at tiny size, so the figures for the shipped
large configs can be trusted without building them.
"""

from __future__ import annotations

import math

from cplm_dist.config import Config
from cplm_dist.config.backbones import backbone
from cplm_dist.model.layer_shapes import layer_shapes, norm_shapes
from cplm_dist.model.loss import padded_vocab_size
from cplm_dist.model.mixes import MIXES


def layer_tensors(cfg: Config) -> list[tuple[int, bool, bool]]:
    """(elements over all tp ranks, split over tp, a weight matrix) of each parameter tensor of
    one transformer layer, in module order: the layer's own shapes (cplm_dist.model.layer_shapes:
    norm, QKV, the qk-norm slot, attention out, norm, MLP fc1 and fc2, biases where the backbone
    has them), so whatever slot a layer gains is counted here as it is built."""
    return [(s.numel, s.split is not None, s.matrix) for s in layer_shapes(cfg.model)]


def _layer_matrices(cfg: Config) -> int:
    """Weight-matrix parameters of one transformer layer (QKV, attention out, MLP fc1 and fc2)."""
    return sum(n for n, _, matrix in layer_tensors(cfg) if matrix)


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
        "layers": m.num_layers * sum(n for n, _, _ in layer_tensors(cfg)),
        "final_norm": sum(_norm_tensors(cfg)),
        "lm_head": 0 if m.tie_embeddings else vocab * D,
        "copy_head": sum(copy_head_parameters(cfg)),
    }
    parts["total"] = sum(parts.values())
    return parts


def parameters_per_device(cfg: Config, tp: int) -> float:
    """Parameters one tp rank holds (before ZeRO-3 sharding), padded vocabulary included: the
    tp-split matrices / tp, plus what every rank replicates (norms, the copy head)."""
    m = cfg.model
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    split_layer = sum(n for n, split, _ in layer_tensors(cfg) if split)
    split = m.num_layers * split_layer + vocab * m.hidden_size * (1 if m.tie_embeddings else 2)
    return split / tp + replicated_parameters(cfg)


def replicated_parameters(cfg: Config) -> int:
    """Parameters every tp rank holds whole: the norms, the copy head, and where the backbone has
    them the row-parallel linears' biases and learned positions (under sequence parallelism, the
    ones whose gradients are summed over tp)."""
    per_layer = sum(n for n, split, _ in layer_tensors(cfg) if not split)
    return cfg.model.num_layers * per_layer + sum(_norm_tensors(cfg)) + _positions(cfg) + sum(copy_head_parameters(cfg))


def matmul_parameters(cfg: Config, *, layers: int | None = None, heads: bool = True) -> int:
    """Parameters that multiply an activation once per token (docs/performance.md): every weight
    matrix of `layers` transformer layers (default all) and, with `heads`, the LM head (V x D, tied
    or not) and the copy head's q, k and gate; not the embedding lookup, the norms or biases."""
    m = cfg.model
    n = (m.num_layers if layers is None else layers) * _layer_matrices(cfg)
    return n + (m.vocab_size * m.hidden_size + copy_head_parameters(cfg)[0] if heads else 0)


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
    layer = [n // tp if split else n for n, split, _ in layer_tensors(cfg)]
    layers = m.num_layers if layers is None else layers
    sizes = [vocab_rows * D] + ([_positions(cfg)] if _positions(cfg) else []) if first else []
    sizes += layer * layers
    if last:
        sizes += [vocab_rows * D] if m.tie_embeddings and not first else []
        sizes += _norm_tensors(cfg) + ([] if m.tie_embeddings else [vocab_rows * D])
        if c.enabled:
            width = c.num_heads * c.head_dim
            sizes += [width * D, width * D] + [n for n, _ in _copy_mix_tensors(cfg)]
    return sizes
