"""Bytes each rank's collectives move in one optimizer step, from the config and layout alone.

Counted as the profiler's collective timer counts them (cplm_dist.profiling.measure,
`collective_bytes`): each call's whole buffer, i.e. an all-reduce's tensor, an all-gather's
gathered output, a reduce-scatter's unscattered input. The keys are the timer's,
"<group>/<collective>". With n = micro-batch x sequence tokens, b the activation bytes and L
layers, per micro-batch:

tensor parallel, without sequence parallelism (megatron-core's linears; tp > 1):
    all_reduce  n D b x (2L forward [attention out, MLP out] + 1 [embedding]
                         + 2L backward [QKV and fc1 input gradients] + 1 [LM-head input gradient]
                         + L with activation checkpointing [the recomputed forward: torch's
                         non-reentrant checkpoint stops once backward's saved tensors are back,
                         before the MLP's output collective, which nothing saved depends on])
                + 3 x 4 n    the loss's max, target logit and sum-exp over the vocabulary shards
                + L x 2 hd b the qk-norm weights' gradients (qwen3: a rank normalises its own heads)
with sequence parallelism (docs/parallelism.md):
    all_gather  n D b x (2L forward + 4L backward [QKV, fc1 inputs again; attention-out and MLP-out
                         gradients] + 2 [LM-head input, forward and again in backward] + 1 [embedding
                         gradient] + 2L recomputed) + the copy head's keys 4 n H_c d_c and terms 4 n k
    reduce_scatter n D b x (2L forward + 2L backward + 1 [embedding] + 1 [LM-head input gradient]
                         + L recomputed) + the copy head's key gradient 4 n H_c d_c
    all_reduce  the replicated weights' gradients (norms, qk-norm, copy head: their elements x b) + 3 x 4 n
data parallel over the P parameter elements a rank holds (after tp), gradients and gathered
parameters in the parameters' dtype, as DeepSpeed 0.19.8 does it (measured on gloo):
    ZeRO-0      all_reduce P once a step (at the accumulation boundary)
    ZeRO-1      all_reduce P once a step + all_gather P (the updated partitions, after the step)
    ZeRO-2      all_reduce P every micro-batch + all_gather P after the step
    ZeRO-3      reduce_scatter P every micro-batch; all_gather: tensors under the persistence
                threshold (1e5 elements) once a step, the rest every micro-batch, twice when the
                rank's gathered parameters exceed the reuse distance (1e9 elements) so that
                forward's copies are released before backward
Pipeline stages (pp > 1, DeepSpeed's pipeline engine; counted for one rank of `stage`, whose
L_s layers replace L above; the embedding's terms belong to the first stage, the LM head's, the
loss's and the copy head's to the last), per micro-batch with a = n D b the activation bytes:
    pp/send, pp/recv   a stage sends its output activation and the ids and labels (16 n) forward
                       to the next stage and the input gradient (a) backward to the previous one;
                       with tp > 1 DeepSpeed partitions both over the tp ranks (a / tp each, plus a
                       few bytes of metadata, not counted) unless sequence parallelism already
                       shards them (a / tp each, no gather)
    tp/all_gather      the partitioned tensors made whole again: a for the received activation
                       (not the first stage), 2a for the sent one kept for backward and the
                       received gradient (not the last stage)
    tied/all_reduce    the tied embedding's gradient between first and last stage, once a step
                       (V/tp x D x b)
Under DualPipeV (parallel.pp_schedule) a rank holds stages r and 2p - 1 - r: its layers' terms are
both stages' (rank 0 has the embedding's and the head's), it sends and receives on both links
(`dualpipev_bytes_per_micro_batch`), whole tensors, and there is no tied all-reduce (rank 0 holds
the one embedding).
    dp                 as above over the stage's own parameters
Muon (optim.name=muon, cplm_dist.profiling.muon_cost), once a step: "tp/all_gather" the tp-split
matrices' directions made whole (fp32), "dp/all_gather" under ZeRO-1/2 the Muon group's direction
gathered over the partition's ranks (fp32).
Context parallelism (cp = c > 1; cplm_dist.model.parallel.context): everything above is
counted for this rank's n = micro-batch x seq / c tokens, and on the cp group, per micro-batch,
with N = micro-batch x seq the positions of the whole sequences ("cp/<collective>"; by part,
`cp_bytes_per_micro_batch`):
    attention   all_gather_into_tensor  2 N nkv/tp hd b x L (each layer's K and V) + L more with
                                        activation checkpointing (the recomputed forward gathers
                                        them again)
                reduce_scatter_tensor   2 N nkv/tp hd b x L (their gradients, to their owners)
    copy head   all_gather_into_tensor  4 N H_c d_c (its fp32 keys, once a forward), and
                reduce_scatter_tensor   4 N H_c d_c (their gradient)
    ids         all_gather              8 N (the input ids, once a forward: the copy head's source
                                        ids) + 8 N under data.document_mask (the position ids); the
                                        model gathers the ids copy on or off
so what the copy head adds to cp's communication is its keys' 8 N H_c d_c bytes (and, read by it
alone, the ids' 8 N), beside attention's 4 N nkv hd b L (+ 2 N nkv hd b L recomputed). With
pipeline stages too (cp x pp) a stage's rank gathers the K and V of its own L_s layers, the copy
head's keys on the last stage only, and the ids (and positions) once a forward on every stage
(cplm_dist.model.parallel.stage_inputs: what its layers' masks and positions are made from).
The dp collectives run over dp x cp ranks (DeepSpeed's sequence-data-parallel group: gradients
summed over cp, ZeRO partitioned over dp x cp), with the same volumes, filed under "dp/".
The step's token count summed over cp (8 bytes a micro-batch) is bookkeeping, not counted.
A sparse model (model.moe; cplm_dist.profiling.expert_cost): each sparse layer's token dispatch and
combine, forward and backward, on the ep group ("ep/": the all-to-all, or the all-gather
dispatcher's gathers and scatters) and at expert_tp = tp > 1 the experts' tp gathers ("tp/"); its
MLP's own tp gathers and scatters are gone (a shared expert keeps them). The routed experts'
gradients are reduced over the expert-data-parallel ranks ("edp/": tp x cp x dp / (ep x
expert_tp) ranks, as ZeRO 0-2 reduce dp's), the rest over dp x cp ("dp/").
Small bookkeeping collectives (gradient norm, overflow checks, loss averaging) are not counted,
nor collectives over a single rank (they move nothing; the profiler skips them too).
"""

from __future__ import annotations

from collections import defaultdict

from cplm_dist.config import Config
from cplm_dist.model.counting import copy_head_parameters, replicated_parameters, summed_over_tp
from cplm_dist.model.layer_shapes import ALWAYS, UNDER_SEQUENCE_PARALLEL
from cplm_dist.model.loss import padded_vocab_size
from cplm_dist.model.mixes import MIXES
from cplm_dist.model.parallel.stages import pipeline_stages, stage_tensor_sizes
from cplm_dist.profiling.expert_cost import (ExpertGroups, dispatcher_bytes_per_micro_batch, local_expert_elements,
                                             stage_sparse_layers)
from cplm_dist.profiling.muon_cost import muon_step_cost

ZERO3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
ZERO3_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance default


def _copy_terms(cfg: Config) -> int:
    """Per-token floats the copy head all-gathers under sequence parallelism: A_t, M_t, and the
    gate logit or sentinel score."""
    return 2 + (MIXES[cfg.copy.mix].gate is not None)


def tp_bytes_per_micro_batch(cfg: Config, *, tp: int, tokens: int, act_bytes: int, activation_checkpointing: bool,
                             sequence_parallel: bool, layers: int | None = None, first: bool = True,
                             last: bool = True, sparse_layers: int = 0) -> dict[str, float]:
    """{collective: bytes} of one micro-batch's forward and backward on the tp group: of `layers`
    transformer layers (default all), `sparse_layers` of them sparse (no MLP gather and scatter of
    their own: cplm_dist.profiling.expert_cost, which adds the dispatcher's), with the embedding
    (`first`) and the head (`last`)."""
    if tp == 1:
        return {}
    m, c = cfg.model, cfg.copy
    L, h = m.num_layers if layers is None else layers, tokens * m.hidden_size * act_bytes
    emb, head = int(first), int(last)
    ckpt = 1 if activation_checkpointing else 0  # a recomputed layer repeats all but its MLP's output collective
    loss = 3 * 4 * tokens * head
    heads = summed_over_tp(cfg, ALWAYS, layers)  # the qk-norm's (over each rank's own heads)
    if not sequence_parallel:
        return {"all_reduce": h * (2 * L + emb + 2 * L + head + ckpt * L) + loss + heads * act_bytes}
    keys = 4 * tokens * c.num_heads * c.head_dim * head if c.enabled else 0
    terms = 4 * tokens * _copy_terms(cfg) * head if c.enabled else 0
    layer = summed_over_tp(cfg, UNDER_SEQUENCE_PARALLEL, layers)  # norms, a router (each rank's positions)
    norms = layer + heads + head * (m.hidden_size + sum(copy_head_parameters(cfg)))  # the replicated weights
    if layers is None:
        assert norms == replicated_parameters(cfg)
    S = 0 if m.moe.shared_ffn_hidden_size else sparse_layers  # a shared expert gathers and scatters as the MLP does
    return {
        "all_gather_into_tensor": h * (2 * L + 4 * L + 2 * head + emb + ckpt * 2 * L - S * (3 + ckpt)) + keys + terms,
        "reduce_scatter_tensor": h * (2 * L + 2 * L + emb + head + ckpt * L - 2 * S) + keys,
        "all_reduce": norms * act_bytes + loss,
    }


def pp_bytes_per_micro_batch(cfg: Config, *, tp: int, pp: int, stage: int, tokens: int, act_bytes: int,
                             sequence_parallel: bool) -> dict[str, float]:
    """{"<group>/<collective>": bytes} of one micro-batch between pipeline stages (module docstring)."""
    a = tokens * cfg.model.hidden_size * act_bytes
    first, last = stage == 0, stage == pp - 1
    partitioned = tp > 1 and not sequence_parallel
    part = a / tp if tp > 1 else a
    forward, backward = part + 16 * tokens, part
    out = {"pp/send": (0 if last else forward) + (0 if first else backward),
           "pp/recv": (0 if first else forward) + (0 if last else backward)}
    if partitioned:
        out["tp/all_gather_into_tensor"] = a * ((0 if first else 1) + (0 if last else 2))
    return out


def dualpipev_bytes_per_micro_batch(cfg: Config, *, tp: int, pp: int, stage: int, tokens: int, act_bytes: int,
                                    sequence_parallel: bool) -> dict[str, float]:
    """pp_bytes_per_micro_batch of a DualPipeV rank (module docstring): the hidden states forward
    (with the ids and labels) and their gradient backward on each of its links, both directions on
    the middle ranks (2 x 1F1B's middle stage), one link on rank 0 (out and back) and on the last
    (its two stages meet there), sent whole at tp > 1 (DeepSpeed's DualPipeV does not partition
    them; the sequence shard under sequence parallelism)."""
    part = tokens * cfg.model.hidden_size * act_bytes / (tp if sequence_parallel else 1)
    links = 2 if 0 < stage < pp - 1 else 1
    both_ways = links * (part + 16 * tokens + part)
    return {"pp/send": both_ways, "pp/recv": both_ways}


def cp_bytes_per_micro_batch(cfg: Config, *, tp: int, cp: int, micro_batch: int, seq_len: int, act_bytes: int,
                             activation_checkpointing: bool, layers: int | None = None,
                             last: bool = True) -> dict[str, dict[str, float]]:
    """{part: {collective: bytes}} of one micro-batch's forward and backward on the cp group, by
    part: "attention" (every layer's K and V; of `layers`, default all), "copy_head" (its keys; on
    the `last` stage), "ids" (the input ids, and the position ids under document masking: once a
    forward on every stage); {} at cp = 1 (module docstring)."""
    if cp == 1:
        return {}
    m, c = cfg.model, cfg.copy
    positions = micro_batch * seq_len  # of the whole sequences: every gather's output
    kv = 2 * positions * (m.num_kv_heads // tp) * m.head_dim * act_bytes * (m.num_layers if layers is None else layers)
    parts = {"attention": {"all_gather_into_tensor": kv * (2 if activation_checkpointing else 1),
                           "reduce_scatter_tensor": kv}}
    if c.enabled and last:
        keys = 4 * positions * c.num_heads * c.head_dim
        parts["copy_head"] = {"all_gather_into_tensor": keys, "reduce_scatter_tensor": keys}
    parts["ids"] = {"all_gather": 8 * positions * (2 if cfg.data.document_mask else 1)}
    return parts


def cp_step_parts(cfg: Config, *, tp: int, cp: int, micro_batch: int, accumulation: int, seq_len: int, precision: str,
                  activation_checkpointing: bool) -> dict[str, float]:
    """{part: bytes} one rank moves on the cp group in an optimizer step: what `step_bytes` files
    under "cp/", by part (attention, copy_head, ids); {} at cp = 1."""
    parts = cp_bytes_per_micro_batch(cfg, tp=tp, cp=cp, micro_batch=micro_batch, seq_len=seq_len,
                                     act_bytes=2 if precision == "bf16" else 4,
                                     activation_checkpointing=activation_checkpointing)
    return {part: sum(sizes.values()) * accumulation for part, sizes in parts.items()}


def dp_bytes_per_step(cfg: Config, *, tp: int, dp: int, zero: int, accumulation: int, param_bytes: int,
                      pp: int = 1, stage: int = 0, experts: float = 0.0) -> dict[str, float]:
    """{collective: bytes} of one optimizer step on the dp group (of pipeline `stage`'s parameters,
    less `experts` elements: a sparse model's routed experts, reduced over their own group);
    `dp` its ranks (dp x cp under context parallelism)."""
    if dp == 1:
        return {}
    sizes = stage_tensor_sizes(cfg, tp, pp, stage)
    p = (sum(sizes) - experts) * param_bytes
    if zero == 0:
        return {"all_reduce": p}
    if zero == 1:
        return {"all_reduce": p, "all_gather_into_tensor": p}
    if zero == 2:
        return {"all_reduce": p * accumulation, "all_gather_into_tensor": p}
    persistent = sum(s for s in sizes if s < ZERO3_PERSISTENCE_THRESHOLD)
    gathered = sum(sizes) - persistent
    per_micro = 2 if gathered > ZERO3_REUSE_DISTANCE else 1
    return {"reduce_scatter_tensor": p * accumulation,
            "all_gather_into_tensor": (persistent + gathered * per_micro * accumulation) * param_bytes}


def step_bytes(cfg: Config, *, tp: int, dp: int, zero: int, micro_batch: int, accumulation: int, seq_len: int,
               precision: str, activation_checkpointing: bool, sequence_parallel: bool, pp: int = 1,
               stage: int = 0, cp: int = 1) -> dict[str, float]:
    """{"<group>/<collective>": bytes} one rank moves in an optimizer step (the module docstring);
    with pipeline stages (pp > 1), a rank of `stage`; with context parallelism (cp > 1) a rank
    holding seq_len / cp positions of each sequence, "cp/" its cp group's and "dp/" the dp x cp
    group's (dp is the data-parallel size alone)."""
    b = 2 if precision == "bf16" else 4
    sp = sequence_parallel and tp > 1
    tokens = micro_batch * seq_len // cp  # this rank's
    out: dict[str, float] = defaultdict(float)
    held = None if pp == 1 else pipeline_stages(cfg, pp, tp)[stage]  # DualPipeV: the rank's two stages
    first, last = (True, True) if held is None else (held.first, held.last)
    layers = None if held is None else held.layers
    own = held or pipeline_stages(cfg, 1, tp)[0]
    sparse = stage_sparse_layers(cfg, own, tp)
    per_micro = tp_bytes_per_micro_batch(cfg, tp=tp, tokens=tokens, act_bytes=b, activation_checkpointing=activation_checkpointing,
                                         sequence_parallel=sp, layers=layers, first=first, last=last, sparse_layers=sparse)
    for name, size in per_micro.items():
        out[f"tp/{name}"] += size * accumulation
    for key, size in dispatcher_bytes_per_micro_batch(cfg, tp=tp, tokens=tokens, act_bytes=b, sparse_layers=sparse,
                                                      activation_checkpointing=activation_checkpointing).items():
        out[key] += size * accumulation  # the token dispatcher's: "ep/", and "tp/" at expert_tp = tp
    if pp > 1:
        between = dualpipev_bytes_per_micro_batch if held.chunks == 2 else pp_bytes_per_micro_batch
        for key, size in between(cfg, tp=tp, pp=pp, stage=stage, tokens=tokens, act_bytes=b, sequence_parallel=sp).items():
            out[key] += size * accumulation
        m = cfg.model
        if m.tie_embeddings and (first or last) and held.chunks == 1:  # DualPipeV: rank 0 holds both ends
            out["tied/all_reduce"] += padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp * m.hidden_size * b
    for sizes in cp_bytes_per_micro_batch(cfg, tp=tp, cp=cp, micro_batch=micro_batch, seq_len=seq_len, act_bytes=b,
                                          activation_checkpointing=activation_checkpointing, layers=layers,
                                          last=last).values():
        for name, size in sizes.items():
            out[f"cp/{name}"] += size * accumulation
    experts = local_expert_elements(cfg, own, tp) if zero < 3 else 0.0  # ZeRO-3 (ep 1): the experts are dp's
    for name, size in dp_bytes_per_step(cfg, tp=tp, dp=dp * cp, zero=zero, accumulation=accumulation, param_bytes=b,
                                        pp=pp, stage=stage, experts=experts).items():
        out[f"dp/{name}"] += size
    for name, size in expert_dp_bytes_per_step(experts * b, ExpertGroups.of(cfg, tp=tp, cp=cp, dp=dp).expert_dp, zero,
                                               accumulation).items():
        out[f"edp/{name}"] += size
    for key, size in muon_step_cost(cfg, own, tp=tp, partitions=dp * cp, zero=zero)[1].items():  # Muon's gathers
        out[key] += size
    return dict(out)


def expert_dp_bytes_per_step(size: float, ranks: int, zero: int, accumulation: int) -> dict[str, float]:
    """{collective: bytes} of one optimizer step on the expert-data-parallel group (`ranks`, the
    ranks holding the same experts) for a rank's `size` bytes of routed experts: ZeRO 0-2 as
    `dp_bytes_per_step` counts them (ZeRO-3 runs at ep 1 only, where the experts are dp's)."""
    if ranks == 1 or not size:
        return {}
    if zero == 0:
        return {"all_reduce": size}
    return {"all_reduce": size * (accumulation if zero == 2 else 1), "all_gather_into_tensor": size}


def ring_factor(collective: str, ranks: int) -> float:
    """Bytes each rank sends per byte of the whole buffer, ring algorithms (NCCL's bus-bandwidth
    convention): an all-reduce 2 (r - 1) / r, an all-gather or reduce-scatter (r - 1) / r."""
    if ranks <= 1:
        return 0.0
    return (2.0 if collective == "all_reduce" else 1.0) * (ranks - 1) / ranks
