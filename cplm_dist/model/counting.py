"""Exact parameter counts from a config alone (no allocation), for any size up to 70B and beyond:
the one place they are written. The training log, the FLOP count (`matmul_parameters`) and the
memory estimator (`parameters_per_device`) all read them from here.

A test ties `parameter_count` to the real module at tiny size, so the figures for the shipped
large configs can be trusted without building them.
"""

from __future__ import annotations

from cplm_dist.config import Config
from cplm_dist.vocab_parallel import padded_vocab_size


def layer_tensors(cfg: Config) -> list[tuple[int, bool, bool]]:
    """(elements over all tp ranks, split over tp, a weight matrix) of each parameter tensor of
    one transformer layer, in module order: llama's norm, QKV, out, norm, SwiGLU fc1 [gate; up],
    fc2; gpt2's the same with LayerNorm biases, linear biases and a GELU fc1 (model.arch)."""
    m = cfg.model
    D, hd, F = m.hidden_size, m.head_dim, m.ffn_hidden_size
    qkv = (m.num_heads + 2 * m.num_kv_heads) * hd
    if m.arch == "gpt2":
        norm = [(D, False, False), (D, False, False)]
        return (norm + [(D * qkv, True, True), (qkv, True, False), (m.num_heads * hd * D, True, True), (D, False, False)]
                + norm + [(F * D, True, True), (F, True, False), (F * D, True, True), (D, False, False)])
    return [(D, False, False), (D * qkv, True, True), (m.num_heads * hd * D, True, True),
            (D, False, False), (2 * F * D, True, True), (F * D, True, True)]


def _layer_matrices(cfg: Config) -> int:
    """Weight-matrix parameters of one transformer layer (QKV, attention out, MLP fc1 and fc2)."""
    return sum(n for n, _, matrix in layer_tensors(cfg) if matrix)


def _norm_tensors(cfg: Config) -> list[int]:
    """The final norm's tensors: RMSNorm's weight, or LayerNorm's weight and bias (gpt2)."""
    return [cfg.model.hidden_size] * (2 if cfg.model.arch == "gpt2" else 1)


def _positions(cfg: Config) -> int:
    """gpt2's learned absolute positions (replicated on every tp rank); llama has none (RoPE)."""
    return cfg.model.max_seq_len * cfg.model.hidden_size if cfg.model.arch == "gpt2" else 0


def _copy_head(cfg: Config) -> tuple[int, int]:
    """(matrix parameters: q, k and the gate's weight; vectors: the gate's bias or the sentinel keys)."""
    c, D = cfg.copy, cfg.model.hidden_size
    if not c.enabled:
        return 0, 0
    width = c.num_heads * c.head_dim
    return 2 * D * width + (D if c.mix == "gate" else 0), {"gate": 1, "sentinel": width, "joint": 0}[c.mix]


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
        "copy_head": sum(_copy_head(cfg)),
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
    """Parameters every tp rank holds whole: the norms, the copy head, and for gpt2 the output
    projections' biases and the learned positions (under sequence parallelism, the ones whose
    gradients are summed over tp)."""
    per_layer = sum(n for n, split, _ in layer_tensors(cfg) if not split)
    return cfg.model.num_layers * per_layer + sum(_norm_tensors(cfg)) + _positions(cfg) + sum(_copy_head(cfg))


def matmul_parameters(cfg: Config) -> int:
    """Parameters that multiply an activation once per token (docs/performance.md): every weight
    matrix of the layers, the LM head (V x D, tied or not), the copy head's q, k and gate; not
    the embedding lookup, the norms or biases."""
    m = cfg.model
    return m.num_layers * _layer_matrices(cfg) + m.vocab_size * m.hidden_size + _copy_head(cfg)[0]


def tensor_sizes_per_device(cfg: Config, tp: int, pp: int = 1, stage: int = 0) -> list[int]:
    """Elements of each parameter tensor one tp rank holds, in module order (they sum to
    `parameters_per_device` at pp = 1): what ZeRO-3's persistence threshold is applied to, tensor
    by tensor. With pipeline stages, those of `stage` (cplm_dist.model.pipeline): the embedding on
    the first, the final norm, LM head and copy head on the last, which under tied embeddings
    holds the embedding's shard too."""
    from cplm_dist.model.pipeline import stage_transformer_layers

    m, c = cfg.model, cfg.copy
    D = m.hidden_size
    vocab_rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    layer = [n // tp if split else n for n, split, _ in layer_tensors(cfg)]
    first, last = stage == 0, stage == pp - 1
    layers = m.num_layers if pp == 1 else stage_transformer_layers(cfg, pp)[stage]
    sizes = [vocab_rows * D] + ([_positions(cfg)] if _positions(cfg) else []) if first else []
    sizes += layer * layers
    if last:
        sizes += [vocab_rows * D] if m.tie_embeddings and not first else []
        sizes += _norm_tensors(cfg) + ([] if m.tie_embeddings else [vocab_rows * D])
        if c.enabled:
            width = c.num_heads * c.head_dim
            sizes += [width * D, width * D] + {"gate": [D, 1], "sentinel": [width], "joint": []}[c.mix]
    return sizes
