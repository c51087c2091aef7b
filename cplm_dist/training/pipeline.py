"""Pipeline parallelism (parallel.pp > 1): the CPLM as DeepSpeed `PipelineModule` stages, run by
DeepSpeed's 1F1B pipeline engine, with megatron-core tensor parallelism inside every stage and
context parallelism across each stage's cp ranks (parallel.cp > 1: every layer's attention gathers
its keys over cp, the head's copy head its keys and the ids, as at pp = 1).

    model = build_pipeline_model(cfg, dims)     # this rank's stage only; dims from init_distributed(tp, pp_size=pp)

The layers, in order (cplm_dist.model.parallel.stages: the split, its weights and names; DeepSpeed builds
only this stage's share), each the model's own part (cplm_dist.model.parts) with DeepSpeed's tuple
interface:

    0       EmbeddingStage    the Embedding: (ids, labels) -> (x, ids, labels)             first stage
    1..L    LayerStage i      the TransformerLayer: (x, ids, labels) -> (x', ids, labels)
            (under document masking the position_ids travel last: (.., labels, positions))
    L+1     the tied embedding again (tie_embeddings): hands its weight to the head
    L+1/2   HeadStage         the Head (final norm, copy head, LM head, mixed loss) -> (3, B, T)
                              per-token nll, LM-only nll, copy share                        last stage

Activation checkpointing and compile are applied to the built stage as to the whole model
(cplm_dist.model.recompute_compile).

The copy head scores every earlier position's id, so the input ids travel with the hidden states
from stage to stage (with the labels: 16 bytes a token against 2 x hidden_size bytes of bf16
activations). Tied embeddings are DeepSpeed's tied layer: the first and last stage each hold the
vocabulary shard, the last stage's copy is synchronised from the first at start and on load, and
their gradients are summed across the two stages before the optimizer step. The stage split is
ours (cplm_dist.model.parallel.stages.partition), balanced by parameters.

Every parameter carries the name it has in `CPLM` (`canonical_named_parameters`), so the seeded
initialisation draws the same weights as at pp = 1 and evaluation loads a pipeline checkpoint
into a plain CPLM (cplm_dist.checkpoint.load_model).
"""

from __future__ import annotations

import torch

from cplm_dist.config import Config
from cplm_dist.config.curriculum import source_names
from cplm_dist.data.loader import IGNORE_INDEX
from cplm_dist.distributed import ParallelDims
from cplm_dist.megatron_compat import import_deepspeed
from cplm_dist.model.block import TransformerLayer
from cplm_dist.model.initialization import init_parameters
from cplm_dist.model.parallel.context import context_of
from cplm_dist.model.parallel.stage_inputs import StageInputs
from cplm_dist.model.parallel.stages import loss_stage, pipeline_layers, schedule_bounds, stages_per_rank
from cplm_dist.model.parts import Embedding, Head, PartSpec
from cplm_dist.model.positions import layer_rope
from cplm_dist.model.recompute_compile import recompute_and_compile
from cplm_dist.training.mpu import context_grid_class
from cplm_dist.training.reduction import BatchSums, ReduceGroups, injected


class EmbeddingStage(Embedding):
    """The embedding part (with learned positions where the backbone has them; not on the tied
    copy of the last stage): (ids, labels) -> (x, ids, labels)."""

    canonical_prefix = ""

    def __init__(self, spec: PartSpec, inputs: StageInputs | None = None, positions: bool = True):
        super().__init__(spec, positions)
        self.inputs = inputs

    def forward(self, inputs):
        ids, labels, *positions = inputs  # positions: data.document_mask
        micro = self.inputs(ids, positions[0] if positions else None)
        return super().forward(ids, 0, micro.positions), ids, labels, *positions


def hand_weight_to_head(stage: EmbeddingStage, inputs):
    """The tied embedding's forward on the last stage: the head multiplies by its weight."""
    return (*inputs, stage.embedding.weight)


class LayerStage(TransformerLayer):
    """Transformer layer `index`: (x, ids, labels) -> (x', ids, labels)."""

    def __init__(self, spec: PartSpec, index: int, inputs: StageInputs):
        super().__init__(spec, index)
        self.canonical_prefix = f"layers.{index}."
        self.model_cfg = spec.model
        self.inputs = inputs  # one set of positions and masks a micro-batch for all of this process's layers

    def forward(self, inputs):
        x, ids, labels, *positions = inputs
        micro = self.inputs(ids, positions[0] if positions else None)
        cos, sin = layer_rope(self.model_cfg, ids.shape[1], device=x.device, position_ids=micro.positions)
        return super().forward(x, cos, sin, micro.masks(self.attention.core)), ids, labels, *positions


class HeadStage(Head):
    """The head part: (x, ids, labels[, tied weight]) -> (3, B, T): per-token nll, LM-only nll, copy share."""

    canonical_prefix = ""

    def __init__(self, spec: PartSpec, inputs: StageInputs):
        super().__init__(spec)
        self.inputs = inputs

    def forward(self, inputs):
        x, ids, labels, *rest = inputs  # rest: [positions (document masking)] [the tied weight]
        tied = rest.pop() if rest and rest[-1].is_floating_point() else None
        position_ids = rest[0] if rest else None
        context = self.inputs(ids, position_ids).context  # context parallel: the whole sequence's ids, positions
        return torch.stack(list(self.token_loss(self.final_norm(x), ids, labels, tied, position_ids, context)))


def layer_specs(cfg: Config, dims: ParallelDims, device, dtype) -> list:
    """DeepSpeed's specs of `pipeline_layers` (DeepSpeed builds this stage's share only)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    context = context_of(dims)
    spec = PartSpec.of(cfg, dims.tp_group, device, dtype, context=context)
    inputs = StageInputs(context)  # shared by the parts DeepSpeed builds on this rank
    tie = {"tied_weight_attr": ["embedding.weight"]}
    specs = []
    for layer in pipeline_layers(cfg):
        if layer.kind == "embedding":
            specs.append(TiedLayerSpec("embedding", EmbeddingStage, spec, inputs, **tie) if cfg.model.tie_embeddings
                         else LayerSpec(EmbeddingStage, spec, inputs))
        elif layer.kind == "layer":
            specs.append(LayerSpec(LayerStage, spec, int(layer.prefix.split(".")[1]), inputs))
        elif layer.kind == "tied":
            specs.append(TiedLayerSpec("embedding", EmbeddingStage, spec, inputs, positions=False,
                                       forward_fn=hand_weight_to_head, **tie))
        else:
            specs.append(LayerSpec(HeadStage, spec, inputs))
    return specs


class PipelineStages:
    """This rank's pipeline stage, mixed into DeepSpeed's PipelineModule (`pipeline_module_class`);
    `loss_fn` turns the head's per-token terms into the micro-batch loss and adds the micro-batch
    to `sums` (cplm_dist.training.reduction), which the train step and validation zero,
    run the schedule, and reduce over `groups`."""

    def __init__(self, cfg: Config, dims: ParallelDims, device, dtype):
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        self.cfg, self.dims = cfg, dims
        self.inject_nonfinite, self.inject_scale = False, 1.0  # fault injection (cplm_dist.training.step)
        self.sums, self.groups = BatchSums(device, len(source_names(cfg))), ReduceGroups.of(dims, loss_stage(cfg))
        # the model axis tp x cp wide: Megatron's rank order (cplm_dist.training.mpu)
        topology = PipeModelDataParallelTopology(num_pp=dims.pp_size, num_mp=dims.tp_size * dims.cp_size, num_dp=dims.dp_size)
        super().__init__(layer_specs(cfg, dims, device, dtype), topology=topology, loss_fn=self.micro_batch_loss,
                         partition_method="parameters")
        if dims.cp_size > 1:
            self._grid = context_grid_class()(self._grid, dims)
        init_parameters(self.canonical_named_parameters(), cfg.model, cfg.copy, cfg.seed, dims.tp_rank, dims.tp_size)

    def canonical_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name in CPLM, parameter) for every parameter this stage holds: the seeded
        initialisation and the weight-decay groups go by these names."""
        return self._canonical("named_parameters")

    def canonical_named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """(name in CPLM, buffer) for every buffer this stage holds (a reshape restores the routers'
        expert bias by them: cplm_dist.checkpoint.reshape_experts)."""
        return self._canonical("named_buffers")

    def _canonical(self, named: str) -> list[tuple[str, torch.Tensor]]:
        funcs = [f for phase in getattr(self, "phase_funcs", [self.forward_funcs]) for f in phase]  # DualPipeV: both
        modules = [f for f in funcs if isinstance(f, torch.nn.Module)] + list(self.tied_modules.values())
        seen, out = set(), []
        for module in modules:
            for name, t in getattr(module, named)():
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append((module.canonical_prefix + name, t))
        return out

    def to(self, *args, **kwargs):
        """Module.to, a no-op when every tensor is on the device asked for already with no dtype
        asked: DeepSpeed moves the stage to its device after building it there, and fake tensors
        (as a dry run builds them, cplm_dist.profiling.dry_run) cannot be swapped by Module.to."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if dtype is None and device is not None and all(t.device == torch.device(device) for t in tensors):
            return self
        return super().to(*args, **kwargs)

    def _partition_layers(self, method="parameters"):
        # DualPipeV: 2 x pp stages, rank r running stage r (phase 0, out) and 2 pp - 1 - r (phase 1,
        # back), as DeepSpeed's DualPipeVModule splits them; our split balances the ranks by parameters
        per_rank = stages_per_rank(self.cfg)
        self.num_stages *= per_rank
        self.parts = schedule_bounds(self.cfg, self.num_stages // per_rank)
        stage = self._topo.get_coord(self.global_rank).pipe
        own = (stage, self.num_stages - 1 - stage)[:per_rank]
        self.phase_bounds = [(self.parts[s], self.parts[s + 1]) for s in own]
        self._set_bounds(*self.phase_bounds[0])

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        """A layer's file, named by its tp rank alone (DeepSpeed's names at cp = 1: the cp ranks
        hold the same weights, and a checkpoint reads the same at any cp)."""
        if self.dims.cp_size == 1:
            return super().ckpt_layer_path(ckpt_dir, local_layer_idx)
        return f"{ckpt_dir}/layer_{local_layer_idx + self._local_start:02d}-model_{self.dims.tp_rank:02d}-model_states.pt"

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        """DeepSpeed's layer files, written by cp rank 0 alone (its cp ranks would write the same files)."""
        if self.dims.cp_rank == 0:
            super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)

    def _synchronize_tied_weights(self):
        # DeepSpeed broadcasts the tied weight in place with autograd on, which leaves a
        # node torch warns about (and may one day refuse) in every backward through it
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def micro_batch_loss(self, out: torch.Tensor, labels) -> torch.Tensor:
        """The last stage's loss function: the micro-batch's loss (this rank's part of its mean over
        the whole sequences), its figures added to `sums`; evaluating, its summed nll and tokens
        (the validation loss is per token over all micro-batches). `labels`: the labels, or
        (labels, source) where the rows' sources travel with them (the per-source sums)."""
        labels, source = labels if isinstance(labels, (tuple, list)) else (labels, None)
        nll, lm_nll, share = out
        if not self.training:
            self.sums.add_tokens(nll, labels, source, lm_nll, share)
            return nll.sum() / (labels != IGNORE_INDEX).sum()  # eval_batch's own figure, not read
        nll = injected(nll, self.inject_nonfinite, self.inject_scale)
        return self.sums.add(nll, lm_nll, share, labels, self.groups.sequence_tokens(labels), source)


def pipeline_module_class(schedule: str = "1f1b"):
    """CPLMPipe: PipelineStages on DeepSpeed's PipelineModule, or on its DualPipeVModule for
    parallel.pp_schedule=dualpipev (deepspeed.initialize then builds the DualPipeV engine);
    DeepSpeed imported only here, its communication layer joined to our process group."""
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_init_required=False)
    from deepspeed.pipe import DualPipeVModule, PipelineModule

    if schedule == "dualpipev":
        return type("CPLMDualPipeV", (PipelineStages, DualPipeVModule), {})
    return type("CPLMPipe", (PipelineStages, PipelineModule), {})


def build_pipeline_model(cfg: Config, dims: ParallelDims, device=None, dtype=torch.float32):
    """This rank's stage of the model (a DeepSpeed PipelineModule)."""
    if dims.pp_size != cfg.parallel.pp:
        raise ValueError(f"parallel.pp={cfg.parallel.pp} but the pipeline group has {dims.pp_size} ranks")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return recompute_and_compile(pipeline_module_class(cfg.parallel.pp_schedule)(cfg, dims, device, dtype), device=device,
                                 activation_checkpointing=cfg.train.activation_checkpointing, compile=cfg.train.compile)
