"""Expert parameters by global id: the one mapping between a rank's local expert keys
(`...mlp.experts.local_experts.<j>.` in the state dict of ep rank r) and the global key every
expert-parallel layout agrees on (`...mlp.experts.local_experts.<r x E/ep + j>.`, the key at
ep = 1). Initialisation seeds by it (cplm_dist.model.initialization); checkpoints, Hugging Face
export and reshapes read and write experts by it. No megatron-core here.
"""

from __future__ import annotations

import re

LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def global_expert_name(name: str, param) -> str:
    """`name` with an expert's local index replaced by its global id (`param.expert_id`, set by
    cplm_dist.model.moe.SparseMLP); other names unchanged."""
    expert = getattr(param, "expert_id", None)
    return name if expert is None else LOCAL_EXPERT.sub(f".local_experts.{expert}.", name, count=1)


def expert_of(name: str) -> int | None:
    """The expert index in a key (local or global, as the key has it), or None."""
    found = LOCAL_EXPERT.search(name)
    return None if found is None else int(found.group(1))


def with_expert(name: str, expert: int) -> str:
    """`name` with its expert index replaced by `expert`."""
    return LOCAL_EXPERT.sub(f".local_experts.{expert}.", name, count=1)
