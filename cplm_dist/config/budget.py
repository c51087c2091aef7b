"""A run's length in tokens: `train.train_tokens` decides train.train_steps, a stage's
`from_tokens` its from_step, at load, so that every tool (training, the planner, the dry run, the
memory estimate) sees the steps.

    train_steps = ceil(train_tokens / (train.global_batch_size x data.seq_length))
    from_step   = ceil(from_tokens  / (train.global_batch_size x data.seq_length))

Rounded up: the run trains at least train_tokens, and the stages before one that begins at
from_tokens train at least from_tokens (at most one step's tokens more). An explicit train_steps
(or from_step) that differs is ignored, said once (cplm_dist.config.notes). The steps follow the
global batch: a resume at another train.global_batch_size recomputes them from the tokens, as if
every step had been at the new batch.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from cplm_dist.config.notes import say_once
from cplm_dist.config.tree import Config
from cplm_dist.errors import ConfigError


def _given(data: Mapping, *keys: Any) -> Any:
    """The value the YAML and overrides gave at `keys` (None where they gave none)."""
    node: Any = data
    for key in keys:
        if isinstance(key, int):
            node = node[key] if isinstance(node, list) and key < len(node) else None
        else:
            node = node.get(key) if isinstance(node, Mapping) else None
    return node


def resolve_token_budget(cfg: Config, given: Mapping) -> None:
    """Set train.train_steps from train.train_tokens and each stage's from_step from its
    from_tokens (module docstring); `given`: the config as written, to tell an explicit value."""
    t, d = cfg.train, cfg.data
    per_step = t.global_batch_size * d.seq_length
    if t.train_tokens is not None and t.train_tokens < 1:
        raise ConfigError(f"train.train_tokens={t.train_tokens} must be a positive number of tokens, or null to "
                          "count the run in train.train_steps")
    for i, stage in enumerate(d.stages):
        if stage.from_tokens is not None and stage.from_tokens < 0:
            raise ConfigError(f"data.stages[{i}].from_tokens={stage.from_tokens} must be >= 0")
    if per_step < 1:  # validation names the bad batch or sequence length
        return
    how = f"ceil(tokens / (train.global_batch_size {t.global_batch_size} x data.seq_length {d.seq_length}))"
    if t.train_tokens is not None:
        steps = math.ceil(t.train_tokens / per_step)
        written = _given(given, "train", "train_steps")
        if written is not None and written != steps:
            say_once(f"train.train_steps={written} is ignored: train.train_tokens={t.train_tokens:,} decides "
                     f"{steps} steps ({how})")
        t.train_steps = steps
    for i, stage in enumerate(d.stages):
        if stage.from_tokens is None:
            continue
        step = math.ceil(stage.from_tokens / per_step)
        written = _given(given, "data", "stages", i, "from_step")
        if written is not None and written != step:
            say_once(f"data.stages[{i}].from_step={written} is ignored: its from_tokens={stage.from_tokens:,} "
                     f"decides from_step {step} ({how})")
        stage.from_step = step
