"""Which complete checkpoints a run deletes after a newer one completes: a pure function of the tags.

Kept, all others deleted:
  - the newest `train.keep_last` complete checkpoints (and the one just written);
  - every checkpoint whose step is a multiple of `train.keep_every` (> 0): milestones for evaluation
    curves and for going back, as OLMo's and torchtitan's keep-every-n;
  - under `optim.schedule=wsd`, the newest checkpoint at or before the step the decay starts
    (train_steps - round(decay_fraction x train_steps)): the stable phase's last state, from which
    another decay (a longer run, another data mix) can branch. Until the decay starts, that is
    simply the newest checkpoint; once a checkpoint inside the decay exists, it stays for good.
"""

from __future__ import annotations

from cplm_dist.config import Config


def step_of(tag: str) -> int:
    return int(tag.removeprefix("step-"))


def decay_start(cfg: Config) -> int | None:
    """The step the WSD decay begins at (None: no WSD decay in this run)."""
    o, total = cfg.optim, cfg.train.train_steps
    if o.schedule != "wsd" or o.decay_fraction <= 0:
        return None
    return total - int(round(o.decay_fraction * total))


def tags_to_delete(tags: list[str], newest: str, keep_last: int, keep_every: int = 0,
                   before_decay: int | None = None) -> list[str]:
    """The complete checkpoints of `tags` (step-NNNNNNNN, any order) to delete once `newest` is complete."""
    ordered = sorted(tags, key=step_of)
    keep = set(ordered[-keep_last:] if keep_last > 0 else []) | {newest}
    if keep_every > 0:
        keep |= {t for t in ordered if step_of(t) % keep_every == 0}
    if before_decay is not None:
        stable = [t for t in ordered if step_of(t) <= before_decay]
        keep |= set(stable[-1:])
    return [t for t in ordered if t not in keep]
