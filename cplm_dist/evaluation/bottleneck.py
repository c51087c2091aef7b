"""The LM head's gradient bottleneck (docs/copy_head.md, "Measuring the gradient bottleneck").

For a batch, G = dL/dZ (tokens x V) and W_lm (V x D) with an orthonormal basis Q of its column
space. The backbone only ever sees G W, which depends on G Q Q^T alone, so

    suppressed = 1 - ||G Q||_F^2 / ||G||_F^2

is the fraction of the logits' gradient the LM head throws away (95-99% in trained LLMs, per
Godey & Artzi 2026). With a copy head, G is the LM-head part of the mixed loss's gradient, and
the gradient that reaches the final hidden states h is split into what arrives through the LM
head (G W) and what arrives through the copy head (q, k, gate), which bypasses W_lm: h is fed to
the two heads as two separate leaves, so autograd reports each path on its own. The figures are
the live diagnostics' (cplm_dist.model.gradient_paths: ||G Q||^2 from W^T W and G W, summed over
the vocabulary shards, so the vocabulary is never gathered).

tools/grad_bottleneck.py measures models at initialisation or a run's checkpoints with
`measurement_batches`, `bottleneck_rows` and `plot_across_steps`.
"""

from __future__ import annotations

import torch

from cplm_dist.model.gradient_paths import gradient_paths


def measure(model, input_ids: torch.Tensor, labels: torch.Tensor, lm_only: bool = False) -> dict:
    """The bottleneck figures of one batch for `model` (a CPLM, any tp). lm_only=True measures
    the LM head's own loss (as if the copy head were off) on the same model."""
    figures = gradient_paths(model, input_ids, labels, lm_only=lm_only)
    keys = ("loss", "suppressed_fraction", "grad_norm_logits", "grad_norm_h_via_lm_head", "grad_norm_h_via_copy_head", "tokens")
    return {**{k: figures[k] for k in keys}, "vocab": model.vocab_size, "hidden": model.model_cfg.hidden_size}


def measurement_batches(cfg, n: int, micro: int, seq: int | None) -> tuple[list, str]:
    """`n` batches of `micro` x `seq` tokens (default data.seq_length) and where they come from: the
    run's validation data when it is there, else seeded random tokens."""
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.loader import ResumableLoader
    from cplm_dist.errors import DataError, UsageError

    seq = seq or cfg.data.seq_length
    if seq > cfg.model.max_seq_len:
        raise UsageError(f"--seq-len {seq} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    try:
        cfg.data.seq_length = seq
        data = build_datasets(cfg, (0, n * micro, 0))
        return [(b["input_ids"], b["labels"]) for b in ResumableLoader(data.valid, micro)], "validation data"
    except DataError:
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(4, cfg.model.vocab_size, (micro, seq + 1), generator=g) for _ in range(n)]
        return [(x[:, :-1], x[:, 1:]) for x in ids], "random tokens"


def bottleneck_rows(model, cfg, label: str, data) -> list[dict]:
    """The figures of `model` averaged over `data`: one row for its loss (the mixture, or the LM
    head's without a copy head) and, with a copy head, one for the LM head's own loss."""
    from cplm_dist.evaluation.generation import device_of

    out, device = [], device_of(model)
    for lm_only in ([False, True] if model.copy_head is not None else [False]):
        ms = [measure(model, ids.to(device), labels.to(device), lm_only=lm_only) for ids, labels in data]
        avg = {k: sum(m[k] for m in ms) / len(ms) for k in ms[0] if isinstance(ms[0][k], float)}
        loss_kind = "LM head alone" if lm_only else ("mixture" if model.copy_head is not None else "LM head")
        out.append({"model": label, "copy": "off" if model.copy_head is None else cfg.copy.mix, "loss_of": loss_kind,
                    "vocab": ms[0]["vocab"], "hidden": ms[0]["hidden"], **avg})
    return out


def plot_across_steps(rows: list[dict], path) -> None:
    """Suppression and the gradient norms against the step, rows of several checkpoints (a PNG)."""
    from cplm_dist.plotting import figure, lines

    suppression = {}
    for r in rows:
        suppression.setdefault(r["loss_of"], []).append((r["step"], r["suppressed_fraction"]))
    mixed = [r for r in rows if r["loss_of"] in ("mixture", "LM head")]
    norms = {"through the LM head": [(r["step"], r["grad_norm_h_via_lm_head"]) for r in mixed],
             "through the copy head": [(r["step"], r["grad_norm_h_via_copy_head"]) for r in mixed]}
    with figure(path, ncols=2, size=(10, 3.8)) as (a, b):
        lines(a, suppression, xlabel="step", ylabel="suppressed fraction of ||dL/dz||^2", title="LM-head gradient suppression")
        lines(b, norms, xlabel="step", ylabel="||dL/dh||", title="gradient reaching the hidden states")
