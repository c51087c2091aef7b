"""Notes: what the config layer (or a check after it) decided for the user without refusing --
an explicit train.train_steps that train.train_tokens overrides, an inherited data.blend that a
derived file's data.stages replaces, a tokenizer smaller than model.vocab_size -- said once.

    say_once("train.train_steps=1000 is ignored: ...")

One line on stderr (`note: ...`), from the first rank only (read from the launcher's variables:
every rank loads the config, before any process group exists), and once per process: the
tools that load a config many times (the planner, a sweep) repeat no note.
"""

from __future__ import annotations

import os
import sys

_said: set[str] = set()
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")  # as cplm_dist.distributed.launch_env reads them


def first_rank() -> bool:
    """Whether this process is rank 0 (or not launched as a rank at all)."""
    rank = next((os.environ[v] for v in _RANK_VARIABLES if v in os.environ), "0")
    return rank.strip() in ("", "0")


def say_once(message: str) -> None:
    """`note: <message>` on stderr, once per process, on the first rank only."""
    if message in _said:
        return
    _said.add(message)
    if first_rank():
        print(f"note: {message}", file=sys.stderr, flush=True)
