"""What a sparse model's experts (model.moe, docs/moe.md) cost one rank, from the config and layout
alone: the terms the memory estimator (cplm_dist.profiling.memory), the communication model
(cplm_dist.profiling.communication) and the planner add for the sparse layers. Dense layers and
everything outside the layers are costed as before.

The expert groups are megatron-core's: per pipeline stage the tp x cp x dp ranks are also
expert_tp x ep x expert-dp ranks (`ExpertGroups`), so an expert's states are partitioned by ZeRO
1-2 over the expert-dp ranks (tp x cp x dp / (ep x expert_tp)) where the dense ones are over dp x
cp, and its gradient is reduced over them.

Routing is taken as balanced (what the auxiliary loss and the expert bias aim for): each of a
rank's r routed positions goes to top_k experts, and what a rank receives over ep equals what it
sends, r x top_k token copies; with model.moe.capacity_factor = c < 1 at most c of them survive
(megatron drops the rest; it pads only under moe_pad_expert_input_to_capacity, which our config
never sets, so c >= 1 changes nothing). An unbalanced router makes the busiest rank's expert
buffers max_load times larger (the `moe.max_load` of a train record). At parallel.tp > 1 (sequence
parallelism, which a sparse model needs) a rank routes its own T/tp positions; at expert_tp = tp
the experts' input is gathered over the tp ranks (every tp rank's routed tokens, each expert
split like the dense MLP), at expert_tp = 1 each rank keeps its own and the experts are whole.

Per position of the rank's micro-batch, what a sparse MLP keeps for backward (b the activation
bytes, D hidden, E experts, k top_k, F one expert's width / expert_tp, r the routed positions a
position stands for: 1 / tp under sequence parallelism, x the expert tokens it stands for: r k c,
times tp when the expert input is gathered; measured with saved-tensor hooks, tests/test_profile.py):

    input       b D without sequence parallelism: megatron's layer runs sequence-first, so the
                layer's (B, T, D) input is transposed into a copy the router keeps
    router      r (4 E [its fp32 scores] + 16 k [two int64 top-k index tensors]; with a load-balancing
                loss 4 E + E + 4 k more [the scores, the routing map, the top-k probabilities it
                reads]; with sigmoid scores 3 E more [the expert bias's path])
    dispatcher  r k c x 12 (the permutation's int64 indices and the permuted fp32 probabilities)
    experts     x (b D [fc1's input: the sorted tokens] + b EXPERT_SAVED x F [megatron's SwiGLU
                expert: fc1's [gate; up] output (2 F), SiLU(gate), up + 0, their product, weighed
                by the probability; the grouped path (cplm_dist.model.moe_grouped) keeps no up + 0:
                EXPERT_SAVED_GROUPED; GELU: EXPERT_SAVED_GELU])
    shared      SHARED_SAVED x b x its width / tp (megatron's MLP: as an expert's, without the
                weighing)
(z-loss's tensors, the expert counts and a capacity factor's drop masks are not counted: E or
fewer elements a layer, or only where tokens are dropped, which the bound above already covers.)
    grouped     model.moe.expert_impl grouped, or auto in bf16 (what a GPU runs; its grouped GEMM
                takes bf16): the local experts' weights stacked into one operand per linear each
                forward, kept for backward (b x their elements, once a sparse layer and micro-batch)

The token dispatcher's collectives per sparse layer and micro-batch ("ep/<collective>", the bytes
the profiler's collective timer counts, `dispatcher_bytes_per_micro_batch`), with n = r x T x B
routed positions of this rank and m = n k c token copies:

    alltoall    all_to_all_single  forward: the tokens out (m D b) and their probabilities (4 m),
                                   the experts' outputs back (m D b); backward: the three gradients
                                   the same sizes; 4 m D b + 8 m, on the ep group (ep > 1)
                expert_tp = tp > 1 tp/all_gather_into_tensor  m tp D b + 4 m tp (tokens and
                                   probabilities gathered, forward) + 4 m tp D (the combine's
                                   gradient, fp32: megatron reduces in the probabilities' dtype)
                                   tp/reduce_scatter_tensor  4 m tp D (the combine, fp32)
                                   + m tp D b + 4 m tp (the gathers' gradients)
    allgather   on the tp x ep group: the hidden states (n ep tp D b), the probabilities and the
                routing map (n ep tp E (4 + 1)) gathered, the output reduce-scattered (n ep tp D b);
                backward the hidden states' and probabilities' gradients reduce-scattered and the
                output's gathered: 3 n ep tp D b + n ep tp E (4 + 4 + 1), filed under "ep/"
                (the tp x ep group spans the ep group's links)
    checkpointing  a recomputed layer runs its forward's collectives again
The dispatcher's all-gather of each expert's token counts (E int64 a rank, over tp x ep) is
bookkeeping, not counted. The sparse layer has no tp gather and scatter of its own under sequence
parallelism (its router sees the rank's positions): the dense MLP's are replaced by the above, and
a shared expert adds them back.

The dispatcher's collectives sit on the critical path: each sparse layer waits for its tokens and
again for its outputs (megatron's overlap of the shared expert with the all-to-all is not
counted), so the planner adds them exposed at the link the ep group spans.
"""

from __future__ import annotations

from dataclasses import dataclass

from cplm_dist.config import Config
from cplm_dist.config.backbones import backbone
from cplm_dist.config.sparse import expert_tp
from cplm_dist.model.parallel.stages import Stage, stage_layer_indices

EXPERT_SAVED = 6  # b F per expert row a gated expert keeps (fc1's 2 F output, SiLU(gate), up + 0, product, weighed)
EXPERT_SAVED_GROUPED = 5  # ... through the grouped GEMM (no up + 0)
EXPERT_SAVED_GELU = 3  # ... a GELU expert (fc1's output, the GELU, weighed)
SHARED_SAVED = {"swiglu": 5, "gelu": 3}  # b x its width per position, the shared expert (megatron's MLP, unweighed)


@dataclass(frozen=True)
class ExpertGroups:
    """A stage's tp x cp x dp ranks seen as expert_tp x ep x expert-dp ranks (megatron-core's)."""

    ep: int
    expert_tp: int
    expert_dp: int

    @classmethod
    def of(cls, cfg: Config, *, tp: int, cp: int, dp: int) -> "ExpertGroups":
        ep, etp = cfg.parallel.ep, expert_tp(cfg)
        return cls(ep, etp, max(1, tp * cp * dp // (ep * etp)))


def sparse(cfg: Config) -> bool:
    return cfg.model.moe.num_experts > 0


def expert_width(cfg: Config) -> int:
    """One routed expert's width (model.moe.ffn_hidden_size; null: the dense width)."""
    return cfg.model.moe.ffn_hidden_size or cfg.model.ffn_hidden_size


def expert_elements(cfg: Config) -> int:
    """Elements of one routed expert (fc1, [gate; up] where gated, and fc2; no biases)."""
    gated = 2 if backbone(cfg.model).gated_mlp else 1
    return (gated + 1) * cfg.model.hidden_size * expert_width(cfg)


def stage_sparse_layers(cfg: Config, stage: Stage, tp: int | None = None) -> int:
    """How many of the layers one rank of `stage` runs are sparse (model.moe.sparse_layers)."""
    if not sparse(cfg):
        return 0
    chosen = set(cfg.model.moe.sparse_layers(cfg.model.num_layers))
    return sum(i in chosen for i in stage_layer_indices(cfg, stage, tp))


def local_expert_elements(cfg: Config, stage: Stage, tp: int | None = None) -> float:
    """Routed-expert elements one rank of `stage` holds: E / ep experts of each of its sparse
    layers, each split over expert_tp (counting.parameters_per_device's share of them)."""
    if not sparse(cfg):
        return 0.0
    e = cfg.model.moe
    return stage_sparse_layers(cfg, stage, tp) * e.num_experts // cfg.parallel.ep * expert_elements(cfg) / expert_tp(cfg)


def _kept(cfg: Config) -> float:
    """The share of routed token copies a capacity factor keeps (balanced routing): min(1, c)."""
    c = cfg.model.moe.capacity_factor
    return 1.0 if c is None else min(1.0, c)


def routed_positions(cfg: Config, tp: int) -> float:
    """Positions a sparse layer routes per position of the rank's micro-batch: 1 / tp under
    sequence parallelism (a rank routes its own), else 1."""
    return 1 / tp if cfg.parallel.sequence_parallel and tp > 1 else 1.0


def expert_tokens(cfg: Config, tp: int) -> float:
    """Expert input rows a rank holds per position of its micro-batch (balanced routing): its
    routed positions x top_k x the kept share, gathered over tp at expert_tp = tp > 1."""
    x = routed_positions(cfg, tp) * cfg.model.moe.top_k * _kept(cfg)
    return x * tp if expert_tp(cfg) == tp > 1 else x


def sparse_mlp_bytes_per_token(cfg: Config, tp: int, act_bytes: int) -> float:
    """What one sparse MLP keeps for backward per position of the rank's micro-batch (the module
    docstring): router, dispatcher, experts, shared expert."""
    m, e, b = cfg.model, cfg.model.moe, act_bytes
    D, E, k = m.hidden_size, e.num_experts, e.top_k
    r = routed_positions(cfg, tp)
    transposed = b * D if r == 1 else 0.0
    balancing = e.aux_loss_coeff > 0 and e.aux_loss != "none"
    router = r * (4 * E + 16 * k + (5 * E + 4 * k if balancing else 0) + (3 * E if e.score == "sigmoid" else 0))
    dispatcher = r * k * _kept(cfg) * 12
    F = expert_width(cfg) / expert_tp(cfg)
    gated = EXPERT_SAVED_GROUPED if grouped_experts(cfg) else EXPERT_SAVED
    experts = expert_tokens(cfg, tp) * b * (D + (gated if backbone(m).gated_mlp else EXPERT_SAVED_GELU) * F)
    shared = b * SHARED_SAVED[backbone(m).mlp] * e.shared_ffn_hidden_size / tp
    return transposed + router + dispatcher + experts + shared


def grouped_experts(cfg: Config) -> bool:
    """Whether the experts run through the grouped GEMM as costed: model.moe.expert_impl grouped,
    or auto in bf16 (auto picks it on CUDA, whose grouped GEMM takes bf16)."""
    impl = cfg.model.moe.expert_impl
    return impl == "grouped" or impl == "auto" and cfg.train.precision == "bf16"


def grouped_stack_bytes(cfg: Config, act_bytes: int) -> float:
    """Per sparse layer and micro-batch: the local experts' weights stacked for the grouped GEMM
    (`grouped_experts`), kept for backward; 0 otherwise."""
    if not sparse(cfg) or not grouped_experts(cfg):
        return 0.0
    return act_bytes * cfg.model.moe.num_experts // cfg.parallel.ep * expert_elements(cfg) / expert_tp(cfg)


def dispatcher_bytes_per_micro_batch(cfg: Config, *, tp: int, tokens: int, act_bytes: int, sparse_layers: int,
                                     activation_checkpointing: bool) -> dict[str, float]:
    """{"<group>/<collective>": bytes} of `sparse_layers` sparse layers' token dispatch and combine
    in one micro-batch's forward and backward (`tokens` positions of this rank; module docstring)."""
    if not sparse(cfg) or not sparse_layers:
        return {}
    m, e, b = cfg.model, cfg.model.moe, act_bytes
    ep, D = cfg.parallel.ep, m.hidden_size
    n = tokens * routed_positions(cfg, tp)
    forward_share = 1 + (1 if activation_checkpointing else 0)  # the recomputed forward's collectives again
    out: dict[str, float] = {}
    if e.dispatcher == "allgather":
        ranks = tp * ep
        if ranks == 1:
            return {}
        g = n * ranks  # every rank's positions, gathered
        out["ep/all_gather_into_tensor"] = (g * D * b + g * e.num_experts * 5) * forward_share + g * D * b
        out["ep/reduce_scatter_tensor"] = g * D * b * forward_share + g * D * b + g * e.num_experts * 4
        return {k: v * sparse_layers for k, v in out.items()}
    copies = n * e.top_k * _kept(cfg)
    if ep > 1:
        forward = 2 * copies * D * b + 4 * copies
        out["ep/all_to_all_single"] = forward * forward_share + 2 * copies * D * b + 4 * copies
    if expert_tp(cfg) == tp > 1:
        g = copies * tp
        out["tp/all_gather_into_tensor"] = (g * D * b + 4 * g) * forward_share + 4 * g * D
        out["tp/reduce_scatter_tensor"] = 4 * g * D * forward_share + g * D * b + 4 * g
    return {k: v * sparse_layers for k, v in out.items()}


def ep_link_within_node(cfg: Config, gpus_per_node: int) -> bool:
    """Whether an ep group lies on one node: its ep x expert_tp consecutive ranks (megatron's
    expert order, expert_tp fastest, then ep) fit in a node."""
    return cfg.parallel.ep * expert_tp(cfg) <= gpus_per_node


def dispatch_ranks(cfg: Config, tp: int) -> int:
    """The ranks the dispatcher's "ep/" collectives span: ep (all-to-all), tp x ep (all-gather)."""
    return cfg.parallel.ep * (tp if cfg.model.moe.dispatcher == "allgather" else 1)


def expert_layouts(cfg: Config, *, stage_ranks: int, tp: int, zero: int, sequence_parallel: bool,
                   gpus_per_node: int):
    """(ep, expert_tp) a layout of a pipeline stage's `stage_ranks` = tp x cp x dp ranks can take,
    by config.sparse's rules: ep divides model.moe.num_experts, ep x expert_tp divides the stage's
    ranks, expert_tp is 1 or tp, ep > 1 only at ZeRO 1-2, tp > 1 only with sequence parallelism;
    those whose ep group lies in a node first (megatron's MoE guide: ep inside a node, across
    nodes only when the experts' memory needs it). A dense model: (1, None) alone."""
    if not sparse(cfg):
        yield 1, None
        return
    if tp > 1 and not sequence_parallel:
        return
    choices = []
    for etp in sorted({tp, 1}, reverse=True):
        for ep in range(1, stage_ranks // etp + 1):
            if cfg.model.moe.num_experts % ep or stage_ranks % (ep * etp) or (ep > 1 and zero not in (1, 2)):
                continue
            choices.append((ep * etp > gpus_per_node, ep, etp))
    for _, ep, etp in sorted(choices):
        yield ep, etp
