"""Pipeline parallelism (parallel.pp > 1): the CPLM as DeepSpeed `PipelineModule` stages, run by
DeepSpeed's 1F1B pipeline engine, with megatron-core tensor parallelism inside every stage.

    model = build_pipeline_model(cfg, dims)     # this rank's stage only; dims from init_distributed(tp, pp_size=pp)

The layers, in order (DeepSpeed builds only this stage's share):

    0       EmbeddingStage    (ids, labels) -> (x, ids, labels)       first stage
    1..L    LayerStage i      (x, ids, labels) -> (x', ids, labels)
    L+1     the tied embedding again (tie_embeddings): hands its weight to the head
    L+1/2   HeadStage         final norm, copy head, LM head, mixed loss -> (3, B, T) per-token
                              nll, LM-only nll, copy share                      last stage

The copy head scores every earlier position's id, so the input ids travel with the hidden states
from stage to stage (with the labels: 16 bytes a token against 2 x hidden_size bytes of bf16
activations). Tied embeddings are DeepSpeed's tied layer: the first and last stage each hold the
vocabulary shard, the last stage's copy is synchronised from the first at start and on load, and
their gradients are summed across the two stages before the optimizer step. The stage split is
ours (`partition`): contiguous layers balanced by parameters, the embedding counted on the first
stage and the LM head (tied or not, V x D either way, the heaviest part of the step) on the last.

Every parameter carries the name it has in `CPLM` (`canonical_named_parameters`), so the seeded
initialisation draws the same weights as at pp = 1 and evaluation loads a pipeline checkpoint
into a plain CPLM (cplm_dist.checkpoint.load_model).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.utils.checkpoint

from cplm_dist.config import Config
from cplm_dist.megatron_compat import import_deepspeed, tensor_parallel
from cplm_dist.model.block import TransformerLayer
from cplm_dist.model.compiled import compile_layers
from cplm_dist.model.copy_head import CopyHead
from cplm_dist.model.cplm import LossHead, megatron_config, vocabulary_shard
from cplm_dist.model.initialization import deferred_init, init_parameters
from cplm_dist.model.norm import make_norm
from cplm_dist.model.rotary import LearnedPositions, layer_rope
from cplm_dist.model.sharding import mark_split
from cplm_dist.model.stages import pipeline_layers, stage_bounds
from cplm_dist.parallel import ParallelDims
from cplm_dist.vocab_parallel import IGNORE_INDEX



class EmbeddingStage(torch.nn.Module):
    canonical_prefix = ""

    def __init__(self, cfg: Config, tp_group, device, dtype, positions: bool = True):
        """positions: gpt2's learned positions live here (not on the tied copy of the last stage)."""
        super().__init__()
        m = cfg.model
        mp = megatron_config(cfg.parallel.tp, device, dtype, cfg.parallel.sequence_parallel)
        padded, _, _ = vocabulary_shard(m, tp_group)
        self.embedding = tensor_parallel.VocabParallelEmbedding(
            padded, m.hidden_size, init_method=deferred_init, config=mp, tp_group=tp_group,
            reduce_scatter_embeddings=mp.sequence_parallel)
        mark_split(self.embedding.weight, dim=0)
        self.embedding.weight.full_rows = m.vocab_size
        self.position_embedding = (LearnedPositions(m.max_seq_len, m.hidden_size, device=device, dtype=dtype,
                                                    sp_group=tp_group if mp.sequence_parallel else None)
                                   if m.arch == "gpt2" and positions else None)

    def forward(self, inputs):
        ids, labels = inputs
        x = self.embedding(ids)
        return (x if self.position_embedding is None else self.position_embedding(x)), ids, labels


def hand_weight_to_head(stage: EmbeddingStage, inputs):
    """The tied embedding's forward on the last stage: the head multiplies by its weight."""
    return (*inputs, stage.embedding.weight)


class LayerStage(TransformerLayer):
    def __init__(self, cfg: Config, index: int, tp_group, device, dtype, checkpointing: bool):
        mp = megatron_config(cfg.parallel.tp, device, dtype, cfg.parallel.sequence_parallel)
        super().__init__(cfg.model, mp, tp_group, cfg.parallel.tp, device=device)
        self.canonical_prefix = f"layers.{index}."
        self.checkpointing = checkpointing
        self.model_cfg = cfg.model
        self.block = super().forward  # the layer itself; torch.compile'd under train.compile (not a module)

    def forward(self, inputs):
        x, ids, labels = inputs
        cos, sin = layer_rope(self.model_cfg, ids.shape[1], device=x.device)
        if self.checkpointing and self.training and torch.is_grad_enabled():
            x = torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)
        else:
            x = self.block(x, cos, sin)
        return x, ids, labels


class HeadStage(LossHead, torch.nn.Module):
    canonical_prefix = ""

    def __init__(self, cfg: Config, tp_group, device, dtype):
        super().__init__()
        m = self.model_cfg = cfg.model
        self.copy_cfg, self.loss_cfg, self.tp_group = cfg.copy, cfg.loss, tp_group
        mp = megatron_config(cfg.parallel.tp, device, dtype, cfg.parallel.sequence_parallel)
        self.sequence_parallel = mp.sequence_parallel
        sp_group = tp_group if self.sequence_parallel else None
        padded, self.v_local, self.real_local = vocabulary_shard(m, tp_group)
        self.final_norm = make_norm(m, device=device, dtype=dtype, grad_group=sp_group)
        self.lm_head = tensor_parallel.ColumnParallelLinear(
            m.hidden_size, padded, config=mp, init_method=deferred_init, bias=False, gather_output=False,
            skip_weight_param_allocation=m.tie_embeddings, tp_group=tp_group)
        if self.lm_head.weight is not None:
            mark_split(self.lm_head.weight, dim=0)
            self.lm_head.weight.full_rows = m.vocab_size
        self.copy_head = CopyHead(m, cfg.copy, device=device, dtype=dtype, sp_group=sp_group) if cfg.copy.enabled else None

    def forward(self, inputs):
        x, ids, labels, *tied = inputs
        out = self.token_loss(self.final_norm(x), ids, labels, tied[0] if tied else None)
        return torch.stack(list(out))  # (3, B, T): nll, lm_nll, copy_share


def layer_specs(cfg: Config, dims: ParallelDims, device, dtype) -> list:
    """DeepSpeed's specs of `pipeline_layers`."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    embed_args = (EmbeddingStage, cfg, dims.tp_group, device, dtype)
    tie = {"tied_weight_attr": ["embedding.weight"]}
    specs = []
    for layer in pipeline_layers(cfg):
        if layer.kind == "embedding":
            specs.append(TiedLayerSpec("embedding", *embed_args, **tie) if cfg.model.tie_embeddings else LayerSpec(*embed_args))
        elif layer.kind == "layer":
            specs.append(LayerSpec(LayerStage, cfg, int(layer.prefix.split(".")[1]), dims.tp_group, device, dtype,
                                   cfg.train.activation_checkpointing))
        elif layer.kind == "tied":
            specs.append(TiedLayerSpec("embedding", *embed_args, positions=False, forward_fn=hand_weight_to_head, **tie))
        else:
            specs.append(LayerSpec(HeadStage, cfg, dims.tp_group, device, dtype))
    return specs


class PipelineStages:
    """This rank's pipeline stage, mixed into DeepSpeed's PipelineModule (`pipeline_module_class`);
    `loss_fn` turns the head's per-token terms into the micro-batch loss (in evaluation also
    adding its summed nll and token count to `eval_sums`)."""

    def __init__(self, cfg: Config, dims: ParallelDims, device, dtype):
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        self.cfg, self.dims = cfg, dims
        self.inject_nonfinite = False
        self.eval_sums = torch.zeros(2, dtype=torch.float64, device=device)
        self._extra = OrderedDict(lm_loss=torch.zeros((), device=device), copy_share=torch.zeros((), device=device))
        topology = PipeModelDataParallelTopology(num_pp=dims.pp_size, num_mp=dims.tp_size, num_dp=dims.dp_size)
        super().__init__(layer_specs(cfg, dims, device, dtype), topology=topology, loss_fn=self.micro_batch_loss,
                         partition_method="parameters")
        init_parameters(self.canonical_named_parameters(), cfg.model, cfg.copy, cfg.seed, dims.tp_rank, dims.tp_size)
        if cfg.train.compile:  # regional compilation, as at pp = 1 (cplm_dist.model.compiled)
            layers = [f for f in self.forward_funcs if isinstance(f, LayerStage)]
            compiled = compile_layers([layer.block for layer in layers], device)
            for layer, block in zip(layers, compiled or []):
                layer.block = block
            for stage in self.forward_funcs:
                if compiled is not None and isinstance(stage, HeadStage) and stage.copy_head is not None:
                    stage.copy_head.compile_pointwise(device)

    def canonical_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name in CPLM, parameter) for every parameter this stage holds: the seeded
        initialisation and the weight-decay groups go by these names."""
        modules = [f for f in self.forward_funcs if isinstance(f, torch.nn.Module)] + list(self.tied_modules.values())
        seen, out = set(), []
        for module in modules:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((module.canonical_prefix + name, p))
        return out

    def _partition_layers(self, method="parameters"):
        self.parts = stage_bounds(self.cfg, self.num_stages)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _synchronize_tied_weights(self):
        # DeepSpeed broadcasts the tied weight in place with autograd on, which leaves a
        # node torch warns about (and may one day refuse) in every backward through it
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def micro_batch_loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        nll, lm_nll, share = out
        tokens = (labels != IGNORE_INDEX).sum()
        if not self.training:  # summed: the validation loss is per token over all micro-batches
            self.eval_sums += torch.stack([nll.sum().double(), tokens.double()])
        self._extra = OrderedDict(lm_loss=(lm_nll.sum() / tokens).detach(), copy_share=(share.sum() / tokens).detach())
        loss = nll.sum() / tokens
        return loss * float("nan") if self.inject_nonfinite else loss

    def get_additional_losses(self):
        """The LM head's own loss and the copy share of the micro-batch: DeepSpeed averages
        them over micro-batches and dp like the loss and sends them to every stage."""
        return self._extra


def pipeline_module_class():
    """CPLMPipe: PipelineStages on DeepSpeed's PipelineModule (DeepSpeed imported only here),
    with DeepSpeed's communication layer joined to our process group."""
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_init_required=False)
    from deepspeed.pipe import PipelineModule

    return type("CPLMPipe", (PipelineStages, PipelineModule), {})


def build_pipeline_model(cfg: Config, dims: ParallelDims, device=None, dtype=torch.float32):
    """This rank's stage of the model (a DeepSpeed PipelineModule)."""
    if dims.pp_size != cfg.parallel.pp:
        raise ValueError(f"parallel.pp={cfg.parallel.pp} but the pipeline group has {dims.pp_size} ranks")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return pipeline_module_class()(cfg, dims, device, dtype)
