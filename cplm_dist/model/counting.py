"""Exact parameter counts from a config alone (no allocation), for any size up to 70B and beyond.

A test ties `parameter_count` to the real module at tiny size, so the figures for the shipped
large configs can be trusted without building them.
"""

from __future__ import annotations

from cplm_dist.config import Config, padded_vocab_size


def parameter_count(cfg: Config, *, padded: bool = False) -> dict[str, int]:
    """Parameters by part, and their total, over all tp ranks (each counted once).

    padded=True counts Megatron's vocabulary padding rows too (what the module holds at parallel.tp).
    """
    m, c = cfg.model, cfg.copy
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tp) if padded else m.vocab_size
    D, hd = m.hidden_size, m.head_dim
    attn = D * (m.num_heads + 2 * m.num_kv_heads) * hd + m.num_heads * hd * D
    mlp = D * 2 * m.ffn_hidden_size + m.ffn_hidden_size * D
    per_layer = attn + mlp + 2 * D  # two RMSNorm weights
    parts = {
        "embedding": vocab * D,
        "layers": m.num_layers * per_layer,
        "final_norm": D,
        "lm_head": 0 if m.tie_embeddings else vocab * D,
        "copy_head": 0,
    }
    if c.enabled:
        width = c.num_heads * c.head_dim
        parts["copy_head"] = 2 * D * width + {"gate": D + 1, "sentinel": width, "joint": 0}[c.mix]
    parts["total"] = sum(parts.values())
    return parts
