"""Exact parameter counts from a config alone (no allocation), for any size up to 70B and beyond:
the one place they are written. The training log, the FLOP count (`matmul_parameters`) and the
memory estimator (`parameters_per_device`) all read them from here.

A test ties `parameter_count` to the real module at tiny size, so the figures for the shipped
large configs can be trusted without building them.
"""

from __future__ import annotations

from cplm_dist.config import Config
from cplm_dist.vocab_parallel import padded_vocab_size


def _layer_matrices(cfg: Config) -> int:
    """Weight-matrix parameters of one transformer layer (QKV, attention out, SwiGLU fc1 and fc2)."""
    m = cfg.model
    D, hd = m.hidden_size, m.head_dim
    return D * (m.num_heads + 2 * m.num_kv_heads) * hd + m.num_heads * hd * D + 3 * D * m.ffn_hidden_size


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
        "layers": m.num_layers * (_layer_matrices(cfg) + 2 * D),  # + two RMSNorm weights
        "final_norm": D,
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
    split = m.num_layers * _layer_matrices(cfg) + vocab * m.hidden_size * (1 if m.tie_embeddings else 2)
    return split / tp + replicated_parameters(cfg)


def replicated_parameters(cfg: Config) -> int:
    """Parameters every tp rank holds whole: the norms and the copy head (under sequence
    parallelism, the ones whose gradients are summed over tp)."""
    return (2 * cfg.model.num_layers + 1) * cfg.model.hidden_size + sum(_copy_head(cfg))


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
    D, hd = m.hidden_size, m.head_dim
    vocab_rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    layer = [D, D * (m.num_heads + 2 * m.num_kv_heads) * hd // tp, m.num_heads * hd * D // tp,
             D, 2 * D * m.ffn_hidden_size // tp, m.ffn_hidden_size * D // tp]
    first, last = stage == 0, stage == pp - 1
    layers = m.num_layers if pp == 1 else stage_transformer_layers(cfg, pp)[stage]
    sizes = [vocab_rows * D] if first else []
    sizes += layer * layers
    if last:
        sizes += [vocab_rows * D] if m.tie_embeddings and not first else []
        sizes += [D] + ([] if m.tie_embeddings else [vocab_rows * D])
        if c.enabled:
            width = c.num_heads * c.head_dim
            sizes += [width * D, width * D] + {"gate": [D, 1], "sentinel": [width], "joint": []}[c.mix]
    return sizes
