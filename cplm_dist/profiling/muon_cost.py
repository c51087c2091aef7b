"""What Muon adds to a step (optim.name=muon; cplm_dist.training.muon), from the config and layout alone.

Each Muon matrix (the transformer layers' 2-D weights, the copy head's q and k under
optim.muon.copy_head) is orthogonalised whole by the ranks that update it:

    ZeRO-0      every rank, every matrix of its stage (the dp ranks compute the same update)
    ZeRO-1/2    each dp x cp rank the matrices its flat fp32 partition touches (the partition is
                the group's flat buffer, matrices in model order, cut into equal parts: a matrix
                crossing a boundary is orthogonalised by both ranks); counted as the mean over
                the partition's ranks

    tp/all_gather   a tp-split matrix's direction gathered whole over tp, fp32 (the gathered
                    output: 4 x its whole elements), once a step for each matrix the rank updates
    dp/all_gather   under ZeRO-1/2 with more than one partition, the group's direction gathered
                    whole over the partition's ranks, fp32: 4 x the rank's Muon elements (its tp
                    shard of every matrix), once a step
    FLOPs           per orthogonalised piece (the matrix, or each of QKV's projections under
                    optim.muon.split_qkv) of sides m <= n, ns_steps x (4 m^2 n + 2 m^3): X X^T,
                    its square, and that times X, on every tp rank of the matrix (each computes the
                    whole)

The profiler's collective timer sees both gathers under those keys (cplm_dist.profiling.measure);
cplm_dist.profiling.communication.step_bytes files them, the planner adds the FLOPs at the
achievable peak as the step's optimizer time.
"""

from __future__ import annotations

import math

from cplm_dist.config import Config
from cplm_dist.model.layer_shapes import QKV_WEIGHT, muon_shapes
from cplm_dist.model.parallel.stages import Stage


def muon_matrices(cfg: Config, stage: Stage) -> list[tuple[tuple[int, int], bool, list[tuple[int, int]]]]:
    """(whole shape, split over tp, the pieces orthogonalised apart) of each Muon matrix of `stage`,
    in model order (the order of the optimizer's Muon group)."""
    m, muon = cfg.model, cfg.optim.muon
    shapes = muon_shapes(m, cfg.copy if muon.copy_head else None)
    layer = [s for s in shapes.values() if not s.name.startswith("copy_head.")]
    out = []
    for _ in range(stage.layers):
        for s in layer:
            pieces = [s.shape]
            if muon.split_qkv and s.name == QKV_WEIGHT:
                pieces = [(m.num_heads * m.head_dim, s.shape[1]), (m.num_kv_heads * m.head_dim, s.shape[1]),
                          (m.num_kv_heads * m.head_dim, s.shape[1])]
            out.append((s.shape, s.split is not None, pieces))
    if stage.last:
        out += [(s.shape, s.split is not None, [s.shape]) for s in shapes.values() if s.name.startswith("copy_head.")]
    return out


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> float:
    """FLOPs of `steps` quintic Newton-Schulz iterations on one matrix (its wide orientation)."""
    small, large = sorted(shape)
    return steps * (4.0 * small * small * large + 2.0 * small**3)


def _updated_share(sizes: list[int], partitions: int) -> list[float]:
    """For each matrix (its elements on this rank, in flat order), the mean over `partitions`
    equal parts of the flat buffer of how many parts touch it, / partitions: the expected number
    of times a rank updates it."""
    total = sum(sizes)
    part = math.ceil(total / partitions)
    shares, offset = [], 0
    for n in sizes:
        first, last = offset // part, (offset + n - 1) // part
        shares.append((last - first + 1) / partitions)
        offset += n
    return shares


def muon_step_cost(cfg: Config, stage: Stage, *, tp: int, partitions: int, zero: int) -> tuple[float, dict[str, float]]:
    """(Newton-Schulz FLOPs one rank runs a step, {"<group>/all_gather": bytes}) of `stage`'s Muon
    matrices; (0, {}) with AdamW. `partitions`: the ranks ZeRO partitions over (dp x cp)."""
    if cfg.optim.name != "muon":
        return 0.0, {}
    matrices = muon_matrices(cfg, stage)
    local = [math.prod(shape) // tp if split else math.prod(shape) for shape, split, _ in matrices]
    sharded = zero >= 1 and partitions > 1
    shares = _updated_share(local, partitions) if sharded else [1.0] * len(matrices)
    steps = cfg.optim.muon.ns_steps
    flops = sum(share * sum(newton_schulz_flops(p, steps) for p in pieces)
                for share, (_, _, pieces) in zip(shares, matrices))
    volumes = {}
    gathered = sum(share * 4 * math.prod(shape) for share, (shape, split, _) in zip(shares, matrices) if split)
    if tp > 1 and gathered:
        volumes["tp/all_gather"] = gathered
    if sharded:
        volumes["dp/all_gather"] = 4.0 * sum(local)
    return flops, volumes
