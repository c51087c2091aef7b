"""What every save records about the parameters, so that a reshape can read the checkpoint at any
layout (cplm_dist.checkpoint.reshape):

    state[UNIVERSAL_INFO]   DeepSpeed's universal-checkpoint layout of the saved names: which
                            tensors are replicated over tp, row-parallel, SwiGLU's two halves,
                            vocabulary rows, and (pp > 1) the tied copy the last stage repeats
    state[PARAMETERS]       ours: {"names": {saved name: CPLM name}, "specs": {CPLM name: [dim,
                            stride, full_rows]}, "order": this rank's CPLM names in its optimizer's
                            index order, "tp_rank": this rank's tp rank}
    state[EXPERT_PARAMETERS] a sparse model's experts in every rank's ZeRO-1/2 partitions, by global
                            id (cplm_dist.checkpoint.reshape_experts.partition_record)

At pp = 1 a saved name is the CPLM name. At pp > 1 DeepSpeed names a stage's parameters by the
global index of their pipeline layer (`3.self_attention.linear_qkv.weight`,
`tied_modules.embedding.embedding.weight`) and every stage holds only its own: the names, specs and
universal layout are gathered over the pipeline once a run (`ParameterRecord.of`), so any rank's
model states describe the whole model. "order" is what a ZeRO-0 checkpoint's torch AdamW state is
indexed by (cplm_dist.training.optim.parameter_groups: the decay group, then the rest).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from cplm_dist.model.parallel.sharding import ShardSpec, spec_of

UNIVERSAL_INFO = "universal_checkpoint_info"  # the key DeepSpeed's converter reads from the model states
PARAMETERS = "cplm_parameters"  # ours, beside it
EXPERT_PARAMETERS = "cplm_expert_partitions"  # ours too: a sparse model's expert partitions (reshape_experts)


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """{name in `model`: its CPLM name} (a pipeline stage maps DeepSpeed's names to CPLM's)."""
    if not hasattr(model, "canonical_named_parameters"):
        return {n: n for n, _ in model.named_parameters()}
    canonical = {id(p): c for c, p in model.canonical_named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters()}


def universal_info(model: torch.nn.Module) -> dict:
    """What DeepSpeed's converter needs to join our tp shards, from the layout marks of `model`'s
    parameters. Replicated tensors are averaged over tp ranks (they are equal; averaging does not
    assert bit-equality of the optimizer moments). A pipeline's tied copy (the embedding the last
    stage holds again) is read from the first stage alone."""
    from deepspeed.checkpoint import constants as c

    groups = {c.PARAMETER_TO_AVERAGE_PATTERNS: [], c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
              c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [], c.VOCABULARY_PARAMETER_PATTERNS: [],
              c.PIPELINE_REPLICATED_PARAMETER_PATTERNS: []}
    vocab = None
    for name, param in model.named_parameters():
        spec, pattern = spec_of(param), f"^{re.escape(name)}$"
        if not spec.is_split:
            groups[c.PARAMETER_TO_AVERAGE_PATTERNS].append(pattern)
        elif spec.stride == 2 and spec.dim == 0:
            groups[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(pattern)
        elif spec.stride != 1:
            raise ValueError(f"{name}: a split of stride {spec.stride} along dim {spec.dim} has no universal form")
        elif spec.dim == 1:
            groups[c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        if spec.full_rows:
            groups[c.VOCABULARY_PARAMETER_PATTERNS].append(pattern)
            vocab = spec.full_rows
        if name.startswith("tied_modules."):
            groups[c.PIPELINE_REPLICATED_PARAMETER_PATTERNS].append(pattern)
    info = {k: v for k, v in groups.items() if v}
    info[c.UNIVERSAL_CHECKPOINT_VERSION_KEY] = c.UNIVERSAL_CHECKPOINT_VERSION_VALUE
    if vocab is not None:
        info[c.ORIGINAL_VOCAB_SIZE] = vocab
    return info


def _union(parts: list[dict]) -> dict:
    """The universal layouts of every stage as one (pattern lists joined, repeats dropped)."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                out[key] = list(dict.fromkeys(out.get(key, []) + value))
            else:
                out.setdefault(key, value)
    return out


class ParameterRecord:
    """This rank's share of what a save records (module docstring), built once a run."""

    def __init__(self, info: dict, names: dict, specs: dict, order: list[str], tp_rank: int,
                 experts: list[dict] | None = None):
        self.info, self.names, self.specs, self.order, self.tp_rank = info, names, specs, order, tp_rank
        self.experts = experts

    @classmethod
    def of(cls, model: torch.nn.Module, cfg, tp_rank: int, pp_size: int,
           experts: list[dict] | None = None) -> "ParameterRecord":
        """Gathered over every rank where the model is split into stages (a collective then).
        `experts`: the expert partitions (reshape_experts.partition_record), already gathered."""
        from cplm_dist.training.optim import parameter_groups

        names = canonical_names(model)
        by_id = {id(p): names[n] for n, p in model.named_parameters()}
        specs = {names[n]: _spec_json(spec_of(p)) for n, p in model.named_parameters()}
        order = [by_id[id(p)] for g in parameter_groups(model, cfg) for p in g["params"]]
        info = universal_info(model)
        if pp_size > 1:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (info, names, specs))
            info = _union([p[0] for p in parts])
            names = {k: v for p in parts for k, v in p[1].items()}
            specs = {k: v for p in parts for k, v in p[2].items()}
        return cls(info, names, specs, order, tp_rank, experts)

    def state(self) -> dict:
        """The entries a save adds to its model states."""
        return {UNIVERSAL_INFO: self.info,
                PARAMETERS: {"names": self.names, "specs": self.specs, "order": self.order, "tp_rank": self.tp_rank},
                **({} if self.experts is None else {EXPERT_PARAMETERS: self.experts})}


def _spec_json(spec: ShardSpec) -> list:
    return [spec.dim, spec.stride, spec.full_rows]


def spec_from_json(value: list) -> ShardSpec:
    dim, stride, full_rows = value
    return ShardSpec(dim, stride, full_rows)


def how_to_split(spec) -> dict:
    """The keys by which DeepSpeed's universal loader cuts a full tensor into tp shards (the
    same its converter writes): the split dimension, SwiGLU's two sub-parameters, vocabulary rows
    to pad. Replicated tensors need none (their full shape is their shape)."""
    from deepspeed.checkpoint import constants as c

    if not spec.is_split:
        return {}
    keys = {c.CAT_DIM: spec.dim}
    if spec.stride > 1:
        keys[c.PARAM_N_SUB_PARAMS] = spec.stride
    if spec.full_rows:
        keys[c.VOCAB_TENSOR] = True
    return keys
