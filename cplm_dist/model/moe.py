"""A sparse MLP: megatron-core's MoE layer (its TopKRouter, all-to-all or all-gather token
dispatcher, SequentialMLP experts and shared expert) in place of the dense MLP of a layer,
built from `model.moe` on the parallel_state groups (tp, ep, expert-tp; cplm_dist.distributed).

    mlp = SparseMLP(spec, layer_index)     # a layer with index in cfg.model.moe.sparse_layers(L)
    y = mlp(x)                             # x (B, T, D), or (T/tp, B, D) under sequence parallelism

Parameters (state-dict keys under `layers.i.mlp.`): `router.weight` (E, D), replicated on every
rank, its gradient summed over tp under sequence parallelism (each rank routes its own
positions); `experts.local_experts.j.linear_fc{1,2}.weight`: this ep rank's experts, j local
(global id = ep_rank x E/ep + j, `expert_id` on each parameter; checkpoints key them by it);
fc1 is [gate; up] for a gated MLP, split over expert-tp like the dense fc1 (stride 2; fc2 along its
input), the shared expert's over tp: each carries the tensor-parallel marks our sharding, the seeded
initialisation and the HF import read (megatron sets them only when it initialises itself);
`shared_experts.*`.
Buffers: `router.expert_bias` (auxiliary-loss-free balancing, persistent), the step's counts.

The auxiliary losses reach the gradient through megatron's MoEAuxLossAutoScaler, whose scale the
train step sets to 1 / accumulation (`set_aux_loss_scale`), the factor DeepSpeed applies to the LM
loss; they are never part of the LM loss or the copy share. `update_expert_bias` applies the step's
summed token counts once a step, after every micro-batch (cplm_dist.training.step); a training
forward counts once, recomputed or not (cplm_dist.model.moe_recompute). Split linears (the
experts at expert_tp > 1, the shared expert) carry megatron's tp marks (`_mark_splits`).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cplm_dist.config import ModelConfig
from cplm_dist.config.backbones import backbone
from cplm_dist.megatron_compat import moe_modules, parallel_state
from cplm_dist.model.moe_grouped import grouped_wanted, use_grouped_gemm
from cplm_dist.model.moe_recompute import checkpointed, recomputing
from cplm_dist.model.moe_stats import record_aux_loss
from cplm_dist.model.parallel.sharding import mark_split

AUX_LOSS_TYPES = {"micro_batch": "aux_loss", "sequence": "seq_aux_loss", "global": "global_aux_loss"}


def megatron_moe_config(m: ModelConfig, tp_size: int, sequence_parallel: bool, dtype: torch.dtype, device: torch.device):
    """megatron-core's TransformerConfig for one sparse layer of model `m` on this rank's groups."""
    e, mods = m.moe, moe_modules()
    balancing = AUX_LOSS_TYPES.get(e.aux_loss, "none") if e.aux_loss_coeff > 0 else "none"
    gated = backbone(m).mlp == "swiglu"
    return mods.TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        ffn_hidden_size=m.ffn_hidden_size, num_moe_experts=e.num_experts, moe_router_topk=e.top_k,
        moe_ffn_hidden_size=e.ffn_hidden_size or m.ffn_hidden_size,
        moe_shared_expert_intermediate_size=e.shared_ffn_hidden_size or None, moe_shared_expert_gate=e.shared_gate,
        moe_router_score_function=e.score, moe_router_pre_softmax=e.score == "softmax" and not e.normalize,
        moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=e.aux_loss_coeff if balancing != "none" else 0.0,
        moe_z_loss_coeff=e.z_loss_coeff or None, moe_router_enable_expert_bias=e.expert_bias,
        moe_router_bias_update_rate=e.bias_update_rate, moe_expert_capacity_factor=e.capacity_factor,
        moe_token_dispatcher_type=e.dispatcher, moe_router_dtype="fp32",
        gated_linear_unit=gated, activation_func=F.silu if gated else _gelu_tanh, add_bias_linear=False,
        tensor_model_parallel_size=tp_size, sequence_parallel=sequence_parallel and tp_size > 1,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        params_dtype=dtype, use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        bf16=dtype == torch.bfloat16, gradient_accumulation_fusion=False,
    )


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class SparseMLP(torch.nn.Module):
    """A layer's MoE MLP; its `moe` attribute is megatron's MoELayer, whose parameters are ours
    under `router.`, `experts.` and `shared_experts.` (the wrapper adds no level to the keys)."""

    def __init__(self, m: ModelConfig, tp_group, tp_size: int, sequence_parallel: bool, layer_index: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        super().__init__()
        mods = moe_modules()
        mods.router_module.save_to_aux_losses_tracker = record_aux_loss  # megatron's tracker allocates on CUDA
        config = megatron_moe_config(m, tp_size, sequence_parallel, dtype, device or torch.device("cpu"))
        spec = mods.get_moe_module_spec(use_te=False, num_experts=m.moe.num_experts, moe_grouped_gemm=False)
        layer = mods.build_module(spec, config=config, layer_number=layer_index + 1)
        layer.set_layer_number(layer_index + 1)  # the router's too: its auxiliary losses are reported by layer
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        # the MoELayer's children become ours: state-dict keys layers.i.mlp.router.weight, ...
        self.router, self.experts = layer.router, layer.experts
        self.shared_experts = getattr(layer, "shared_experts", None)
        self._layer = [layer]  # not a child (its parameters are already ours, above)
        if grouped_wanted(m.moe.expert_impl, device or torch.device("cpu")):
            use_grouped_gemm(self.experts)  # one grouped GEMM for all local experts (cplm_dist.model.moe_grouped)
        offset = parallel_state.get_expert_model_parallel_rank() * layer.num_local_experts
        for j, expert in enumerate(self.experts.local_experts):
            for param in expert.parameters():
                param.expert_id = offset + j
        self._mark_splits(config)
        self.num_experts, self.top_k = m.moe.num_experts, m.moe.top_k
        self.register_buffer("load", torch.zeros(m.moe.num_experts, dtype=torch.float64), persistent=False)
        self.register_buffer("routing_sums", torch.zeros(3, dtype=torch.float64), persistent=False)  # tokens, dropped, entropy
        self._replay = collections.deque()  # counters before each checkpointed forward (cplm_dist.model.moe_recompute)
        self._found = None  # the counters a recomputation found, put back after it
        self.router.register_forward_pre_hook(self._before_routing)
        self.router.register_forward_hook(self._count)
        self.router.register_forward_hook(self._after_routing)
        if self.sequence_parallel:
            for param in self._replicated():
                param.register_hook(self._sum_over_tp)

    def _mark_splits(self, config) -> None:
        """megatron marks its split linears only when it initialises them (we do: perform_initialization
        is off), and our seeded initialisation and checkpoints read the marks (cplm_dist.model.parallel.sharding):
        the shared expert is split over tp like the dense MLP, the experts over expert-tp when it is
        tp (the same ranks; at expert_tp = 1 < tp each expert is whole on its rank, unmarked); fc1 column-wise ([gate; up]: stride 2), fc2 row-wise."""
        stride = 2 if config.gated_linear_unit else 1
        mlps = [self.shared_experts] if self.shared_experts is not None else []
        if config.expert_tensor_parallel_size == config.tensor_model_parallel_size:  # split over the tp ranks (1: whole)
            mlps += list(self.experts.local_experts)
        for mlp in mlps:
            mark_split(mlp.linear_fc1.weight, dim=0, stride=stride)
            mark_split(mlp.linear_fc2.weight, dim=1)

    def _replicated(self) -> list[torch.nn.Parameter]:
        """Parameters every tp rank holds whole but applies to its own positions (router, shared gate)."""
        params = [self.router.weight]
        if self.shared_experts is not None and getattr(self.shared_experts, "gate_weight", None) is not None:
            params.append(self.shared_experts.gate_weight)
        return params

    def _sum_over_tp(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=self.tp_group)
        return grad

    def _counters(self) -> list[torch.Tensor]:
        """What a training forward adds to: megatron's router counts (expert bias, global aux loss) and ours."""
        r = self.router
        return [t for t in (r.local_tokens_per_expert, getattr(r, "global_tokens_per_expert", None),
                            getattr(r, "ga_steps", None), self.load, self.routing_sums) if t is not None]

    def _before_routing(self, router, _inputs) -> None:
        """Under activation checkpointing: a checkpointed forward keeps the counters it starts from; its
        recomputation starts from them again and `_after_routing` puts back what it found."""
        if not (router.training and torch.is_grad_enabled()):
            return
        if recomputing():
            self._found = [t.clone() for t in self._counters()]
            if self._replay:
                for t, kept in zip(self._counters(), self._replay.popleft()):
                    t.copy_(kept)
        elif checkpointed():
            self._replay.append([t.clone() for t in self._counters()])

    def _after_routing(self, _router, _inputs, _output) -> None:
        if self._found is not None:
            for t, found in zip(self._counters(), self._found):
                t.copy_(found)
            self._found = None

    def reset_replay(self) -> None:
        """Once a step: checkpointed forwards never recomputed (none in training) leave nothing behind."""
        self._replay.clear()

    def _count(self, router, inputs, output) -> None:
        """Per training forward: routed tokens per expert, dropped assignments, router entropy. (Grad
        mode is read here, outside the no_grad below: inside it, it would always read off.)"""
        if not (router.training and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            _, routing_map = output
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            self.load += routing_map.sum(0).double().to(self.load.device)
            logits = F.linear(x, router.weight.float())
            if router.score_function == "softmax":
                probs = logits.softmax(-1)
            else:
                probs = torch.sigmoid(logits)
                probs = probs / probs.sum(-1, keepdim=True)
            entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)
            tokens = x.shape[0]
            self.routing_sums += torch.tensor([tokens, tokens * self.top_k - float(routing_map.sum()), float(entropy.sum())],
                                              dtype=torch.float64, device=self.routing_sums.device)

    def train(self, mode: bool = True) -> "SparseMLP":
        self._layer[0].training = mode
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self._layer[0]
        h = x if self.sequence_parallel else x.transpose(0, 1).contiguous()  # megatron's [T, B, D]
        out, bias = layer(h)
        if bias is not None:
            out = out + bias
        return out if self.sequence_parallel else out.transpose(0, 1)


def sparse_layers(model: torch.nn.Module) -> list[SparseMLP]:
    return [m for m in model.modules() if isinstance(m, SparseMLP)]


def set_aux_loss_scale(accumulation: int, device: torch.device) -> None:
    """The auxiliary losses' gradient scale: 1 / accumulation, as DeepSpeed scales the LM loss."""
    scaler = moe_modules().moe_utils.MoEAuxLossAutoScaler
    scaler.set_loss_scale(torch.tensor(1.0 / accumulation, device=device))


@torch.no_grad()
def update_expert_bias(model: torch.nn.Module) -> None:
    """Once a step, after its micro-batches: each sparse layer's expert bias moves by
    bias_update_rate towards balance, from its routed-token counts summed over the step's
    micro-batches and the stage's tp x cp x dp ranks (megatron's rule); the counts zeroed. The
    global auxiliary loss's running counts are reset too (megatron's per-step reset)."""
    utils = moe_modules().moe_utils
    for layer in sparse_layers(model):
        router = layer.router
        if router.enable_expert_bias:
            router.expert_bias.copy_(utils.get_updated_expert_bias(
                router.local_tokens_per_expert, router.expert_bias, router.config.moe_router_bias_update_rate))
            router.local_tokens_per_expert.zero_()
        router.reset_global_aux_loss_tracker()
        layer.reset_replay()
