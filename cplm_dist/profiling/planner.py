"""Which layout to train a config with on a cluster: enumerate, keep what fits, predict the step.

For every tp (dividing the heads and the MLP, within a node) x cp (context parallelism: powers of
two dividing gpus / tp, the sequence divisible by 2 x cp, and by 2 x cp x tp under sequence
parallelism; with pipeline stages too) x pp (dividing gpus / (tp x cp), at most num_layers) x
dp = gpus / (tp x cp x pp) x ZeRO (0-3; 0-1 at pp > 1, 1 only in bf16: what
config.validate_pipeline accepts) x micro-batch (with whole accumulation m = global / (micro x dp))
x activation checkpointing x sequence parallelism (tp > 1):

    memory   cplm_dist.profiling.memory.estimate (must fit `headroom` of the GPU's memory); at
             pp > 1 its heaviest pipeline stage
    compute  training FLOPs per device (cplm_dist.training.throughput.flops_per_token, plus the
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
    cp       context parallelism (cp > 1): cplm_dist.profiling.communication's "cp/" bytes (every
             layer's K and V gathered and their gradients reduce-scattered, the copy head's keys,
             the ids) x the ring factor / the link the cp group spans (NVLink while tp x cp fits a
             node), all exposed: each layer's attention waits for its gathered K and V. Compute
             per device is unchanged (each rank holds T / cp tokens and, by the 2 x cp chunks'
             balance, as much of the causal triangle); the dp x cp group reduces the gradients
    optimizer with optim.name=muon, the Newton-Schulz FLOPs a rank runs (cplm_dist.profiling.muon_cost)
             at `achievable` x peak, exposed (the step waits for it); its gathers are in tp and dp
             (the dp one after the step, exposed as ZeRO's parameter gather is)
    ep       a sparse model (model.moe): each layout also takes every (ep, expert_tp) config.sparse
             allows (expert_cost.expert_layouts: ep dividing the experts, ep x expert_tp a stage's
             ranks, ZeRO 1-2 at ep > 1, those whose ep group lies in a node first, as megatron's MoE
             guide advises); memory holds E / ep experts a sparse layer, their states over the
             expert-dp ranks; compute is the active FLOPs (top_k experts); the dispatcher's
             all-to-all bytes (cplm_dist.profiling.expert_cost) x the ring factor / the link the ep
             group spans (NVLink while ep x expert_tp fits a node), exposed: each sparse layer
             waits for its tokens and its outputs; the experts' gradients, reduced over the
             expert-dp ranks, join dp's
    step     compute + tp + cp + ep + exposed dp + optimizer;  MFU = model FLOPs per device / step / peak

Pipeline parallelism (pp = p > 1, DeepSpeed's 1F1B engine; ranks ((pp_rank x dp + dp_rank) x cp +
cp_rank) x tp + tp_rank, so consecutive stages are tp x cp x dp ranks apart and a multi-node job
has a stage boundary on the network). Each stage (cplm_dist.profiling.memory.pipeline_stages: the model's own split)
does, per micro-batch and per device:

    compute  its layers' FLOPs (and the LM head's and copy head's on the last stage) x micro x seq
             / (tp x cp), at `achievable` x peak (train.compile compiles each stage's layers as at pp = 1)
    cp       its own layers' K/V gathers, the copy head's keys on the last stage, the ids once a
             micro-batch (cp > 1), at the link the cp group spans, exposed
    tp       its own layers' collectives (the embedding's on the first stage, the LM head's, the
             loss's and the copy head's on the last) and the gathers of the tp-partitioned p2p
             tensors, exposed
    p2p      "pp/send" + "pp/recv" of the stage: the hidden states forward, micro x seq x D x b
             (a tp partition of them with tp > 1, the sequence shard under sequence parallelism)
             plus 16 bytes a token of ids and labels, and their gradient backward; blocking in
             DeepSpeed's schedule, so exposed, at the slowest link between consecutive stages
(volumes: cplm_dist.profiling.communication.step_bytes(pp=p, stage=s))

The slowest stage sets the pace: a step is m + p - 1 slots of its (compute + tp + cp + p2p), i.e.
(compute + tp + cp + p2p) x (m + p - 1) / m, the bubble (p - 1) / (m + p - 1) of the step idle. After
the last backward (DeepSpeed's ReduceTiedGrads, ReduceGrads, then the optimizer), exposed: the
tied embedding's gradient all-reduce between the first and last stage (V/tp x D x b, 2 ranks,
under tie_embeddings) and the largest stage's dp x cp volume (its own parameters; the pipeline
engine reduces after the schedule, nothing overlaps), so

    step     (compute + tp + cp + ep + p2p) / (1 - bubble) + tied + dp + optimizer (the slowest stage's)

The later stages' reductions could partly hide under the pipeline's drain; that is not counted.
Every pipeline layout is predicted under both schedules it can run (`schedules`): 1F1B, and
DualPipeV (parallel.pp_schedule=dualpipev: a rank runs stages r and 2p - 1 - r of 2p, its compute,
tp, cp and dp terms both stages', p2p on both links, no tied all-reduce, the bubble
(2p - 2.5) / (3m + 2p - 2.5) and p + 1/2 micro-batches in flight: cplm_dist.profiling.memory).
Within TIE of each other the simpler layout ranks first, 1F1B before DualPipeV, an ep group inside a node
before one across nodes.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

from cplm_dist.config import BatchLayout, Config, ConfigError, Layout, check_tp_divides, divisors
from cplm_dist.config.sparse import expert_tp as expert_tp_of
from cplm_dist.profiling.communication import ring_factor, step_bytes
from cplm_dist.profiling.expert_cost import ExpertGroups, dispatch_ranks, ep_link_within_node, expert_layouts
from cplm_dist.profiling.memory import GIB, Stage, bubble, estimate, pipeline_stages
from cplm_dist.profiling.muon_cost import muon_step_cost
from cplm_dist.training.throughput import flops_per_token, forward_flops

# Layouts whose predicted steps differ by less than this fraction rank as equal; among them the
# smaller pp (no pipeline engine, whose schedule the model simplifies), the smaller cp, the lower ZeRO stage (fewer,
# larger collectives), the larger micro-batch (better-shaped matmuls), no recomputation and the
# smaller tp come first: the model does not see those costs.
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


@dataclass(frozen=True, kw_only=True)
class Plan(Layout):
    """A layout (cplm_dist.config.Layout) with its batch and what the model predicts of its step."""

    micro_batch: int
    accumulation: int
    activation_checkpointing: bool
    sequence_parallel: bool
    memory_gib: float
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    exposed_dp_s: float
    pp_comm_s: float  # the slowest stage's p2p a step + the tied embedding's gradient all-reduce (0 at pp = 1)
    bubble: float  # the share of the step the pipeline idles: (pp - 1) / (m + pp - 1) under 1F1B
    step_s: float
    mfu: float
    tokens_per_s: float
    cp_comm_s: float = 0.0  # the cp group's gathers and reduce-scatters a step, exposed
    optimizer_s: float = 0.0  # Muon's Newton-Schulz a step (0 with AdamW, whose elementwise step is not counted)
    expert_tp: int = 1  # a sparse model's experts' tp (parallel.expert_tp: 1 or tp)
    ep_comm_s: float = 0.0  # the token dispatcher's all-to-alls a step (the slowest stage's), exposed

    def as_dict(self) -> dict:
        return asdict(self)


def layer_flop_share(cfg: Config, seq_len: int) -> float:
    """The transformer layers' share of a step's FLOPs: what checkpointing computes again."""
    return 3 * forward_flops(cfg, seq_len, heads=False) / flops_per_token(cfg, seq_len)


def stage_flops_per_token(cfg: Config, stage: Stage, seq_len: int) -> tuple[float, float]:
    """(training FLOPs, recomputed forward FLOPs under checkpointing) per token of one pipeline
    stage, over its tp ranks: flops_per_token's terms for its own layers, the LM head's and copy
    head's on the last stage (the stages' FLOPs sum to flops_per_token)."""
    forward = forward_flops(cfg, seq_len, layers=stage.layers, heads=stage.last)
    return 3.0 * forward, float(forward_flops(cfg, seq_len, layers=stage.layers, heads=False))


def _within_nodes(groups, gpus_per_node: int) -> bool:
    """Every group of ranks (each given by its lowest and highest rank) on one node."""
    return all(lo // gpus_per_node == hi // gpus_per_node for lo, hi in groups)


def pipeline_links(cluster: Cluster, *, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[float, float, float, float]:
    """GB/s of (the dp x cp groups, the slowest consecutive-stage pair, the first-to-last-stage
    pair, the cp groups) on rank = ((pp_rank x dp + dp_rank) x cp + cp_rank) x tp + tp_rank:
    intra-node when every such group lies on one node, else the network."""
    block, gpn = tp * cp * dp, cluster.gpus_per_node

    def bw(within: bool) -> float:
        return cluster.intra_gbps if within else cluster.inter_gbps

    dp_groups = ((s * block + t, s * block + block - tp + t) for s in range(pp) for t in range(tp))
    p2p_pairs = ((r, r + block) for r in range((pp - 1) * block))
    tied_pairs = ((r, r + (pp - 1) * block) for r in range(block))
    cp_groups = ((b * tp * cp + t, b * tp * cp + (cp - 1) * tp + t) for b in range(pp * dp) for t in range(tp))
    return (bw(_within_nodes(dp_groups, gpn)), bw(_within_nodes(p2p_pairs, gpn)), bw(_within_nodes(tied_pairs, gpn)),
            bw(_within_nodes(cp_groups, gpn)))


def predict(cfg: Config, cluster: Cluster, *, tp: int, zero: int, micro_batch: int, seq_len: int, global_batch: int,
            activation_checkpointing: bool, sequence_parallel: bool, pp: int = 1, cp: int = 1,
            pp_schedule: str = "1f1b", ep: int = 1, expert_tp: int | None = None) -> Plan:
    """Memory and step time of one layout (the module docstring); `ep` and `expert_tp` (null:
    tp) a sparse model's expert layout."""
    batch = BatchLayout.for_world(cluster.gpus, tp=tp, pp=pp, cp=cp, micro=micro_batch, global_batch=global_batch)
    dp, accumulation = batch.dp, batch.accumulation
    precision = cfg.train.precision
    cfg = copy.deepcopy(cfg)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.sequence_parallel = tp, pp, cp, sequence_parallel
    cfg.parallel.ep, cfg.parallel.expert_tp = ep, expert_tp
    cfg.parallel.pp_schedule = pp_schedule if pp > 1 else "1f1b"
    memory = estimate(cfg, tp=tp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, zero=zero, precision=precision,
                      activation_checkpointing=activation_checkpointing, pp=pp, accumulation=accumulation, cp=cp).total
    tokens = global_batch * seq_len
    model_flops = flops_per_token(cfg, seq_len) * tokens / cluster.gpus
    peak = cluster.peak_tflops * 1e12
    tp_bw = (cluster.intra_gbps if tp <= cluster.gpus_per_node else cluster.inter_gbps) * 1e9
    layout = dict(tp=tp, dp=dp, zero=zero, micro_batch=micro_batch, accumulation=accumulation, seq_len=seq_len,
                  precision=precision, activation_checkpointing=activation_checkpointing,
                  sequence_parallel=sequence_parallel)

    def seconds(volumes: dict, group: str, ranks: int, bw: float, names: tuple[str, ...] | None = None) -> float:
        return sum(size * ring_factor(key.split("/")[1], ranks) / bw for key, size in volumes.items()
                   if key.startswith(group + "/") and (names is None or key.split("/")[1] in names))

    groups = ExpertGroups.of(cfg, tp=tp, cp=cp, dp=dp)
    ep_gbps = cluster.intra_gbps if ep_link_within_node(cfg, cluster.gpus_per_node) else cluster.inter_gbps

    def expert_seconds(volumes: dict, dp_gbps: float, names: tuple[str, ...] | None = None) -> tuple[float, float]:
        """(the dispatcher's seconds on the ep group, the experts' gradient seconds on the expert-dp group)."""
        dispatch = seconds(volumes, "ep", dispatch_ranks(cfg, tp), ep_gbps * 1e9) if names is None else 0.0
        return dispatch, seconds(volumes, "edp", groups.expert_dp, dp_gbps * 1e9, names)

    if pp > 1:
        return _predict_pipeline(cfg, cluster, layout, pp=pp, cp=cp, memory=memory, model_flops=model_flops,
                                 tokens=tokens, peak=peak, tp_bw=tp_bw, seconds=seconds, expert_seconds=expert_seconds)
    recompute = 1 + layer_flop_share(cfg, seq_len) / 3 if activation_checkpointing else 1.0
    compute = model_flops * recompute / (peak * cluster.achievable)
    volumes = step_bytes(cfg, **layout, cp=cp)
    gpn = cluster.gpus_per_node
    dp_bw = (cluster.intra_gbps if tp * cp * dp <= gpn else cluster.inter_gbps) * 1e9  # the dp x cp group
    cp_bw = (cluster.intra_gbps if tp * cp <= gpn else cluster.inter_gbps) * 1e9
    tp_comm = seconds(volumes, "tp", tp, tp_bw)
    cp_comm = seconds(volumes, "cp", cp, cp_bw)
    ep_comm, edp_comm = expert_seconds(volumes, dp_bw / 1e9)
    dp_comm = seconds(volumes, "dp", dp * cp, dp_bw) + edp_comm
    backward_per_micro = compute * 2 / 3 / accumulation
    def unhidden(comm: float, window: float) -> float:
        return comm - cluster.overlap * min(comm, window)

    if zero == 0:
        exposed = dp_comm
    elif zero in (1, 2):
        gathers = ("all_gather_into_tensor", "all_gather")
        gather = seconds(volumes, "dp", dp * cp, dp_bw, gathers) + expert_seconds(volumes, dp_bw / 1e9, gathers)[1]  # after the step
        reduce_calls = 1 if zero == 1 else accumulation  # ZeRO-1 reduces in the last backward only
        exposed = gather + reduce_calls * unhidden((dp_comm - gather) / reduce_calls, backward_per_micro)
    else:
        exposed = accumulation * unhidden(dp_comm / accumulation, compute / accumulation)
    optimizer = muon_step_cost(cfg, pipeline_stages(cfg, 1, tp)[0], tp=tp, partitions=dp * cp, zero=zero)[0] \
        / (peak * cluster.achievable)
    step = compute + tp_comm + cp_comm + ep_comm + exposed + optimizer
    return Plan(tp=tp, pp=1, dp=dp, zero_stage=zero, micro_batch=micro_batch, accumulation=accumulation,
                activation_checkpointing=activation_checkpointing, sequence_parallel=sequence_parallel,
                memory_gib=memory / GIB, compute_s=compute, tp_comm_s=tp_comm, dp_comm_s=dp_comm, exposed_dp_s=exposed,
                pp_comm_s=0.0, bubble=0.0, step_s=step, mfu=model_flops / step / peak, tokens_per_s=tokens / step,
                cp=cp, cp_comm_s=cp_comm, optimizer_s=optimizer, ep=ep, expert_tp=groups.expert_tp, ep_comm_s=ep_comm)


def _predict_pipeline(cfg: Config, cluster: Cluster, layout: dict, *, pp: int, cp: int, memory: float,
                      model_flops: float, tokens: int, peak: float, tp_bw: float, seconds, expert_seconds) -> Plan:
    """predict at pp > 1: the slowest stage's slots (its compute over tp x cp ranks, its tp, cp
    and p2p collectives), the bubble, then the tied and dp x cp reductions."""
    tp, dp, m = layout["tp"], layout["dp"], layout["accumulation"]
    dp_gbps, p2p_gbps, tied_gbps, cp_gbps = pipeline_links(cluster, tp=tp, pp=pp, dp=dp, cp=cp)
    speed = peak * cluster.achievable
    micro_tokens = layout["micro_batch"] * layout["seq_len"]
    slowest, dp_comm, tied, optimizer = None, 0.0, 0.0, 0.0
    kinds = {(s.layers, s.first, s.last): s for s in pipeline_stages(cfg, pp, tp)}  # stages alike cost alike
    for stage in kinds.values():
        volumes = step_bytes(cfg, **layout, pp=pp, stage=stage.index, cp=cp)
        flops, recomputed = stage_flops_per_token(cfg, stage, layout["seq_len"])
        if layout["activation_checkpointing"]:
            flops += recomputed
        compute = flops * micro_tokens * m / (tp * cp) / speed
        tp_comm = seconds(volumes, "tp", tp, tp_bw)
        cp_comm = seconds(volumes, "cp", cp, cp_gbps * 1e9)
        p2p = (volumes.get("pp/send", 0.0) + volumes.get("pp/recv", 0.0)) / (p2p_gbps * 1e9)
        ep_comm, edp_comm = expert_seconds(volumes, dp_gbps)
        busy = compute + tp_comm + cp_comm + ep_comm + p2p
        if slowest is None or busy > slowest[0]:
            slowest = (busy, compute, tp_comm, p2p, cp_comm, ep_comm)
        dp_comm = max(dp_comm, seconds(volumes, "dp", dp * cp, dp_gbps * 1e9) + edp_comm)
        tied = max(tied, seconds(volumes, "tied", 2, tied_gbps * 1e9))
        optimizer = max(optimizer, muon_step_cost(cfg, stage, tp=tp, partitions=dp * cp, zero=layout["zero"])[0] / speed)
    busy, compute, tp_comm, p2p, cp_comm, ep_comm = slowest
    schedule = cfg.parallel.pp_schedule
    idle = bubble(pp, m, schedule)
    step = busy / (1 - idle) + tied + dp_comm + optimizer
    return Plan(tp=tp, pp=pp, dp=dp, zero_stage=layout["zero"], micro_batch=layout["micro_batch"], accumulation=m,
                activation_checkpointing=layout["activation_checkpointing"],
                sequence_parallel=layout["sequence_parallel"], memory_gib=memory / GIB, compute_s=compute,
                tp_comm_s=tp_comm, dp_comm_s=dp_comm, exposed_dp_s=dp_comm, pp_comm_s=p2p + tied, bubble=idle,
                step_s=step, mfu=model_flops / step / peak, tokens_per_s=tokens / step, cp=cp, cp_comm_s=cp_comm,
                pp_schedule=schedule, optimizer_s=optimizer, ep=cfg.parallel.ep, expert_tp=expert_tp_of(cfg),
                ep_comm_s=ep_comm)


def context_sizes(gpus: int, seq_len: int) -> list[int]:
    """The cp a world of `gpus` (after tp) can take for sequences of seq_len: powers of two
    dividing it with seq_len divisible by 2 x cp (1 always)."""
    return [cp for cp in divisors(gpus) if cp & (cp - 1) == 0 and (cp == 1 or seq_len % (2 * cp) == 0)]


def layouts(cfg: Config, cluster: Cluster, *, seq_len: int, global_batch: int, max_micro_batch: int = 64,
            max_cp: int | None = None):
    """Every layout the stack can run for this global batch: (tp, pp, zero, micro, ckpt, sp, cp);
    cp up to `max_cp` (default: any), with pipeline stages or without."""
    t, L = cfg.train, cfg.model.num_layers
    for tp in divisors(cluster.gpus):
        if tp > cluster.gpus_per_node:
            continue  # tp across nodes: every layer's collectives on the network
        try:
            check_tp_divides(cfg.model, tp)
        except ConfigError:
            continue
        for cp in context_sizes(cluster.gpus // tp, seq_len):
            if max_cp is not None and cp > max_cp:
                continue
            for pp in divisors(cluster.gpus // (tp * cp)):
                if pp > L or (pp > 1 and cfg.model.init_from):
                    continue  # config.validate_pipeline: a transformer layer a stage; init_from: pp = 1 only
                zeros = (0, 1, 2, 3) if pp == 1 else (1,) if t.precision == "bf16" else (0, 1)
                sps = [sp for sp in ((False, True) if tp > 1 else (False,))
                       if not sp or seq_len % (tp * (2 * cp if cp > 1 else 1)) == 0]  # each chunk split over tp
                for micro in (2**i for i in range(max_micro_batch.bit_length())):  # 1, 2, 4 .. max_micro_batch
                    try:
                        BatchLayout.for_world(cluster.gpus, tp=tp, pp=pp, cp=cp, micro=micro, global_batch=global_batch)
                    except ConfigError:
                        continue  # no whole accumulation: training would refuse it
                    for zero in zeros:
                        if zero == 3 and cfg.loss.impl == "chunked":
                            continue  # config.validate_train rejects it
                        if zero == 0 and t.precision == "bf16" and tp > 1 and cfg.optim.clip_grad > 0:
                            continue  # the same
                        if cfg.optim.name == "muon" and (zero == 3 or (zero == 0 and t.precision == "bf16")):
                            continue  # config.validate_muon: no rank holds a whole matrix / DeepSpeed's bf16 wrapper
                        for ckpt in (False, True):
                            for sp in sps:
                                yield tp, pp, zero, micro, ckpt, sp, cp


def schedules(cfg: Config, pp: int, accumulation: int) -> tuple[str, ...]:
    """The pipeline schedules a layout can run: 1F1B, and DualPipeV where each rank's two stages
    get a transformer layer each and a step has 2 x pp micro-batches (config.validate_pipeline,
    check_schedule)."""
    if pp == 1:
        return ("1f1b",)
    return ("1f1b", "dualpipev") if cfg.model.num_layers >= 2 * pp and accumulation >= 2 * pp else ("1f1b",)


def plan(cfg: Config, cluster: Cluster, *, seq_len: int, global_batch: int, max_pp: int | None = None,
         max_cp: int | None = None, ep: int | None = None) -> tuple[list[Plan], int]:
    """(layouts that fit, fastest first; how many were considered), pp up to `max_pp`, cp up
    to `max_cp` and a sparse model's ep only `ep` (default: any)."""
    fits, considered = [], 0
    for tp, pp, zero, micro, ckpt, sp, cp in layouts(cfg, cluster, seq_len=seq_len, global_batch=global_batch, max_cp=max_cp):
        if max_pp is not None and pp > max_pp:
            continue
        for ep_size, etp in expert_layouts(cfg, stage_ranks=cluster.gpus // pp, tp=tp, zero=zero, sequence_parallel=sp,
                                      gpus_per_node=cluster.gpus_per_node):
            if ep is not None and ep_size != ep:
                continue
            for schedule in schedules(cfg, pp, global_batch // (micro * (cluster.gpus // (tp * cp * pp)))):
                considered += 1
                p = predict(cfg, cluster, tp=tp, pp=pp, zero=zero, micro_batch=micro, seq_len=seq_len,
                            global_batch=global_batch, activation_checkpointing=ckpt, sequence_parallel=sp, cp=cp,
                            pp_schedule=schedule, ep=ep_size, expert_tp=etp)
                if p.memory_gib <= cluster.headroom * cluster.memory_gib:
                    fits.append(p)
    if fits:  # within TIE of each other: the simpler layout first (fewer stages, ep in a node, 1F1B, less cp, ...)
        fastest = min(p.step_s for p in fits)
        gpn = cluster.gpus_per_node
        fits.sort(key=lambda p: (round(p.step_s / fastest / TIE), p.pp, p.ep * p.expert_tp > gpn, p.pp_schedule != "1f1b",
                                 p.cp, p.zero_stage, -p.micro_batch, p.activation_checkpointing, p.tp, p.ep, p.step_s))
    return fits, considered
