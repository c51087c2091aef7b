"""The one line for a collective that failed because another rank died or hung: which ranks went
quiet (their heartbeats stopped, cplm_dist.distributed.heartbeat), on which host, doing what.

    message = lost_rank_message(error, phase, heartbeat, dims.hosts, timeout_minutes)   # None: not a lost rank
"""

from __future__ import annotations

import torch.distributed as dist

from cplm_dist.distributed.heartbeat import Heartbeat
from cplm_dist.distributed.hosts import JoinedHosts

# gloo reports a peer that stopped answering (a hung rank, a cut link) as a timed-out wait, or,
# when its own pair times out first, as "Application timeout caused pair closure"
MARKERS = ("Timed out", "timed out", "Application timeout", "Connection closed by peer", "Connection reset",
           "NCCL communicator was aborted")


def lost_rank_message(e: Exception, phase: str, heartbeat: Heartbeat | None, joined: JoinedHosts,
                      timeout_minutes: float) -> str | None:
    """One line for a collective that failed because another rank died or hung, else None; it
    names the ranks that went quiet (their heartbeats stopped) and what they were doing, while this
    rank was in `phase`."""
    text = str(e)
    if not isinstance(e, (RuntimeError, dist.DistError)) or not any(m in text for m in MARKERS):
        return None
    first = text.strip().splitlines()[0][:160]
    peer = joined.ranks_at(text)
    quiet = heartbeat.quiet_ranks() if heartbeat is not None else []
    seen = "; ".join(f"rank {r}{joined.on_host(r)} went quiet {age:.0f}s ago while {their_phase}" + (f" (step {step})" if step else "")
                     for r, age, their_phase, step in quiet[:3])
    return (f"rank {dist.get_rank() if dist.is_initialized() else '?'} lost contact with another rank while {phase} "
            f"({first}{'; that is ' + peer if peer else ''}){'; ' + seen if seen else ''}; a rank died or hung longer than "
            f"train.collective_timeout_minutes={timeout_minutes}: the job stops; continue with --resume auto")
