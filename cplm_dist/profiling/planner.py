"""Which layout to train a config with on a cluster: enumerate, keep what fits, predict the step.

For every tp (dividing the heads and the MLP, within a node) x dp x ZeRO 0-3 x micro-batch
(with whole accumulation) x activation checkpointing x sequence parallelism (tp > 1):

    memory   cplm_dist.profiling.memory.estimate (must fit `headroom` of the GPU's memory)
    compute  training FLOPs per device (cplm_dist.profiling.throughput.flops_per_token, plus the
             recomputed forward of the layers with checkpointing) at `achievable` x the GPU's
             dense peak: the stated fraction a well-shaped matmul reaches, not a measurement
    tp       cplm_dist.profiling.communication bytes x the ring factor / the bandwidth of the
             link the tp group spans (NVLink inside a node), all exposed: megatron-core's
             tp collectives wait for their result
    dp       the same for the dp group (the network once it spans nodes); the gradient
             reductions of ZeRO 1-3 overlap the backward they are issued in (DeepSpeed's
             overlap_comm, on by default on CUDA), ZeRO-3's parameter gathers are prefetched under
             the micro-batch's compute: `overlap` (stated, 0.8) of the part that fits under that
             compute is hidden, the rest exposed; the all-gather of updated parameters after the
             step (ZeRO 1-2) and ZeRO-0's all-reduce are exposed
    step     compute + tp + exposed dp;  MFU = model FLOPs per device / step / peak

Pipeline parallelism is not built (docs/parallelism.md): a size for which no layout fits
needs it, and `plan` says so instead of proposing one.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

from cplm_dist.config import Config, ConfigError, check_tp_divides
from cplm_dist.model.counting import _layer_matrices
from cplm_dist.profiling.communication import ring_factor, step_bytes
from cplm_dist.profiling.memory import GIB, estimate
from cplm_dist.profiling.throughput import flops_per_token


# Layouts whose predicted steps differ by less than this fraction rank as equal; among them the
# lower ZeRO stage (fewer, larger collectives), the larger micro-batch (better-shaped matmuls),
# no recomputation and the smaller tp come first: the model does not see those costs.
TIE = 0.02


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    memory_gib: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 of an H100 / H200 SXM
    achievable: float = 0.48  # fraction of peak reached: cplm-1.7b on one H200, compiled, measured 48% (docs/benchmarks.md)
    intra_gbps: float = 360.0  # GB/s per GPU a ring reaches over NVLink (bus bandwidth)
    inter_gbps: float = 40.0  # GB/s per GPU over the network (a 400 Gb/s NIC per GPU, ~80%)
    headroom: float = 0.9  # the share of memory a layout may fill
    overlap: float = 0.8  # the share of ZeRO communication issued under compute that it actually hides


@dataclass
class Plan:
    tp: int
    dp: int
    zero: int
    micro_batch: int
    accumulation: int
    activation_checkpointing: bool
    sequence_parallel: bool
    memory_gib: float
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    exposed_dp_s: float
    step_s: float
    mfu: float
    tokens_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def layer_flop_share(cfg: Config, seq_len: int) -> float:
    """The transformer layers' share of a step's FLOPs: what checkpointing computes again."""
    m = cfg.model
    layers = 2 * m.num_layers * _layer_matrices(cfg) + 4 * m.num_layers * seq_len * m.num_heads * m.head_dim
    return 3 * layers / flops_per_token(cfg, seq_len)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def predict(cfg: Config, cluster: Cluster, *, tp: int, zero: int, micro_batch: int, seq_len: int, global_batch: int,
            activation_checkpointing: bool, sequence_parallel: bool) -> Plan:
    """Memory and step time of one layout (the module docstring)."""
    dp = cluster.gpus // tp
    accumulation = global_batch // (micro_batch * dp)
    precision = cfg.train.precision
    cfg = copy.deepcopy(cfg)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, sequence_parallel
    memory = estimate(cfg, tp=tp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, zero=zero, precision=precision,
                      activation_checkpointing=activation_checkpointing).total
    tokens = global_batch * seq_len
    model_flops = flops_per_token(cfg, seq_len) * tokens / cluster.gpus
    recompute = 1 + layer_flop_share(cfg, seq_len) / 3 if activation_checkpointing else 1.0
    peak = cluster.peak_tflops * 1e12
    compute = model_flops * recompute / (peak * cluster.achievable)
    volumes = step_bytes(cfg, tp=tp, dp=dp, zero=zero, micro_batch=micro_batch, accumulation=accumulation,
                         seq_len=seq_len, precision=precision, activation_checkpointing=activation_checkpointing,
                         sequence_parallel=sequence_parallel)
    tp_bw = (cluster.intra_gbps if tp <= cluster.gpus_per_node else cluster.inter_gbps) * 1e9
    dp_bw = (cluster.intra_gbps if tp * dp <= cluster.gpus_per_node else cluster.inter_gbps) * 1e9

    def seconds(group: str, ranks: int, bw: float, names: tuple[str, ...] | None = None) -> float:
        return sum(size * ring_factor(key.split("/")[1], ranks) / bw for key, size in volumes.items()
                   if key.startswith(group + "/") and (names is None or key.split("/")[1] in names))

    tp_comm = seconds("tp", tp, tp_bw)
    dp_comm = seconds("dp", dp, dp_bw)
    backward_per_micro = compute * 2 / 3 / accumulation
    def unhidden(comm: float, window: float) -> float:
        return comm - cluster.overlap * min(comm, window)

    if zero == 0:
        exposed = dp_comm
    elif zero in (1, 2):
        gather = seconds("dp", dp, dp_bw, ("all_gather_into_tensor",))
        reduce_calls = 1 if zero == 1 else accumulation  # ZeRO-1 reduces in the last backward only
        exposed = gather + reduce_calls * unhidden((dp_comm - gather) / reduce_calls, backward_per_micro)
    else:
        exposed = accumulation * unhidden(dp_comm / accumulation, compute / accumulation)
    step = compute + tp_comm + exposed
    return Plan(tp=tp, dp=dp, zero=zero, micro_batch=micro_batch, accumulation=accumulation,
                activation_checkpointing=activation_checkpointing, sequence_parallel=sequence_parallel,
                memory_gib=memory / GIB, compute_s=compute, tp_comm_s=tp_comm, dp_comm_s=dp_comm, exposed_dp_s=exposed,
                step_s=step, mfu=model_flops / step / peak, tokens_per_s=tokens / step)


def layouts(cfg: Config, cluster: Cluster, *, seq_len: int, global_batch: int, max_micro_batch: int = 64):
    """Every layout the stack can run for this global batch: (tp, zero, micro, ckpt, sp)."""
    for tp in _divisors(cluster.gpus):
        if tp > cluster.gpus_per_node:
            continue  # tp across nodes: every layer's collectives on the network
        try:
            check_tp_divides(cfg.model, tp)
        except ConfigError:
            continue
        dp = cluster.gpus // tp
        micro = 1
        while micro <= max_micro_batch:
            if global_batch % (micro * dp) == 0:
                for zero in (0, 1, 2, 3):
                    for ckpt in (False, True):
                        for sp in ((False, True) if tp > 1 and seq_len % tp == 0 else (False,)):
                            yield tp, zero, micro, ckpt, sp
            micro *= 2


def plan(cfg: Config, cluster: Cluster, *, seq_len: int, global_batch: int) -> tuple[list[Plan], int]:
    """(layouts that fit, fastest first; how many were considered)."""
    fits, considered = [], 0
    for tp, zero, micro, ckpt, sp in layouts(cfg, cluster, seq_len=seq_len, global_batch=global_batch):
        considered += 1
        p = predict(cfg, cluster, tp=tp, zero=zero, micro_batch=micro, seq_len=seq_len, global_batch=global_batch,
                    activation_checkpointing=ckpt, sequence_parallel=sp)
        if p.memory_gib <= cluster.headroom * cluster.memory_gib:
            fits.append(p)
    if fits:
        fastest = min(p.step_s for p in fits)
        fits.sort(key=lambda p: (round(p.step_s / fastest / TIE), p.zero, -p.micro_batch, p.activation_checkpointing,
                                 p.tp, p.step_s))
    return fits, considered

