"""A sparse model's experts through a reshape (cplm_dist.checkpoint.reshape): a checkpoint saved
at one ep (expert tp, tp, dp, ZeRO-1/2) continues at another with each expert's fp32 master weight,
moments (AdamW's exp_avg and exp_avg_sq, or Muon's momentum_buffer) and step, by global expert id.

Why not DeepSpeed's converter alone: `ds_to_universal` joins a parameter's ZeRO fragments over
the dp ranks of one tp rank, by the parameter's name. An expert's optimizer group is partitioned
over its expert-data-parallel group instead (cplm_dist.training.expert_groups), which at ep > 1,
or at expert_tp = 1 under tp > 1, is not that dp group; and an expert's name is local to its ep
rank (`local_experts.0` is expert 0 on ep rank 0 and expert 2 on ep rank 1, at 4 experts and ep 2),
so it would join other experts' fragments under one name. So the experts go apart:

    at the first save   `partition_record`: each rank's ZeRO file, its pp / ep / expert-tp /
                        expert-dp ranks and {engine name: [global name, shard shape]} of its
                        experts, gathered over all ranks into the model states (EXPERT_PARAMETERS,
                        cplm_dist.checkpoint.parameter_record)
    to universal        DeepSpeed's converter reads the checkpoint without experts (`without_experts`,
                        applied as it loads each file); `experts_to_universal` writes
                        zero/<global name>/{fp32,exp_avg,exp_avg_sq | momentum_buffer,step}.pt from
                        each expert's fragments, joined over its expert-dp ranks in rank order, then
                        over its expert-tp ranks (fc1 [gate; up] rows, fc2 columns)
    from universal      DeepSpeed's ZeRO loader reads each parameter's folder under the name its
                        optimizer knows it by: `by_global_id` names every expert by its global id while
                        it loads, so each rank reads its own experts at any ep (and cuts its expert-tp
                        shard by the split keys written with them)
    buffers             the universal loader restores parameters only; the routers' expert bias (equal
                        on every rank) comes from the saved module states (`load_expert_bias`)
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.checkpoint.expert_files import expert_ranks
from cplm_dist.checkpoint.manifest import Manifest, ReshapeError
from cplm_dist.checkpoint.parameter_record import EXPERT_PARAMETERS, UNIVERSAL_INFO, canonical_names, how_to_split
from cplm_dist.checkpoint.safe_io import load_states, model_states_file, safe_load
from cplm_dist.model.moe_naming import expert_of, global_expert_name
from cplm_dist.model.parallel.sharding import ShardSpec, join_shards

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # AdamW's, Muon's
PARAM_SHAPES, PARAM_SLICE_MAPPINGS = "param_shapes", "param_slice_mappings"  # DeepSpeed's keys


def _is_expert(param) -> bool:
    return getattr(param, "expert_id", None) is not None


def partition_record(engine, cfg, dims) -> list[dict] | None:
    """Every rank's expert partitions (module docstring), gathered over all ranks: a collective
    on every rank of a sparse ZeRO-1/2 run; None (no collective) otherwise. Built once a run."""
    if cfg.model.moe.num_experts == 0 or cfg.train.zero_stage not in (1, 2):
        return None
    names = canonical_names(engine.module)
    ep_rank, etp_rank, edp_rank = expert_ranks()
    mine = {"file": Path(engine._get_zero_ckpt_name("", "")).name,  # DeepSpeed 0.19's name of this rank's ZeRO file
            "pp_rank": dims.pp_rank, "ep_rank": ep_rank, "expert_tp_rank": etp_rank, "edp_rank": edp_rank,
            "experts": {n: [global_expert_name(names[n], p), list(p.shape)]
                        for n, p in engine.module.named_parameters() if _is_expert(p)}}
    gathered = [None] * dims.world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def _unescaped(pattern: str) -> str:
    return re.sub(r"\\(.)", r"\1", pattern)


def without_experts(obj) -> None:
    """What DeepSpeed's converter reads of a checkpoint file, minus the experts (in place): their
    module weights, their shapes and universal-layout patterns in the model states, their slices
    in each ZeRO file (the experts' groups stay, with nothing in them to extract)."""
    if not isinstance(obj, dict):
        return
    if isinstance(obj.get("module"), dict):
        obj["module"] = {k: v for k, v in obj["module"].items() if expert_of(k) is None}
    if isinstance(obj.get(PARAM_SHAPES), list):
        obj[PARAM_SHAPES] = [OrderedDict((n, s) for n, s in g.items() if expert_of(n) is None) for g in obj[PARAM_SHAPES]]
    info = obj.get(UNIVERSAL_INFO)
    if isinstance(info, dict):  # patterns are ^<escaped name>$
        obj[UNIVERSAL_INFO] = {k: [p for p in v if expert_of(_unescaped(p)) is None] if isinstance(v, list) else v
                               for k, v in info.items()}
    inner = obj.get("optimizer_state_dict")
    if isinstance(inner, dict) and isinstance(inner.get(PARAM_SLICE_MAPPINGS), list):
        inner[PARAM_SLICE_MAPPINGS] = [OrderedDict((n, a) for n, a in g.items() if expert_of(n) is None)
                                       for g in inner[PARAM_SLICE_MAPPINGS]]


def expert_split(name: str, gated: bool) -> ShardSpec:
    """How an expert weight splits over expert-tp ranks, whatever the layout it was saved at
    (cplm_dist.model.moe.SparseMLP._mark_splits): fc1 by rows ([gate; up] halves when gated), fc2 by columns."""
    return ShardSpec(0, 2 if gated else 1) if ".linear_fc1." in name else ShardSpec(1)


def experts_to_universal(step_dir: Path, out: Path, record: list[dict], m) -> None:
    """zero/<global name>/<state>.pt for every expert of the ZeRO-1/2 checkpoint `step_dir` of
    model `m`, from the ZeRO files `record` names (rank 0, after DeepSpeed's converter wrote the
    rest). Memory holds one ZeRO file and one expert at a time: the fragments go through files in
    out/experts-tmp first, as DeepSpeed's converter does with its own."""
    from deepspeed.checkpoint import constants as c

    from cplm_dist.config.backbones import backbone

    gated, tmp = backbone(m).mlp == "swiglu", out / "experts-tmp"
    fragments: dict[tuple[str, str], dict[int, dict[int, Path]]] = {}  # (name, state) -> etp -> edp -> its file
    shapes, steps = {}, {}
    for entry in record:
        if not entry["experts"]:
            continue
        sd = safe_load(step_dir / entry["file"], map_location="cpu")["optimizer_state_dict"]
        fp32, states = sd[c.SINGLE_PARTITION_OF_FP32_GROUPS], sd[c.BASE_OPTIMIZER_STATE]["state"]
        for g, mapping in enumerate(sd[PARAM_SLICE_MAPPINGS]):
            for engine_name, where in mapping.items():
                if engine_name not in entry["experts"]:
                    continue
                name, shape = entry["experts"][engine_name]
                shapes[name] = shape
                if "step" in states[g]:
                    steps[name] = states[g]["step"]
                flat = {"fp32": fp32[g], **{k: v for k, v in states[g].items() if k in MOMENTS}}
                for key, tensor in flat.items():
                    etp, edp = entry["expert_tp_rank"], entry["edp_rank"]
                    path = tmp / name / f"{key}.{etp}.{edp}.pt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(tensor.narrow(0, where.start, where.numel).clone(), path)
                    fragments.setdefault((name, key), {}).setdefault(etp, {})[edp] = path
        del sd, fp32, states
    if not fragments:
        raise ReshapeError(f"{step_dir}: its ZeRO files hold no expert partitions although the model has experts")
    for (name, key), by_etp in fragments.items():
        shards, numel = [], torch.Size(shapes[name]).numel()
        for etp in sorted(by_etp):
            flat = torch.cat([safe_load(by_etp[etp][r], map_location="cpu") for r in sorted(by_etp[etp])])
            if flat.numel() != numel:
                raise ReshapeError(f"{step_dir}: the ZeRO fragments of {name} ({key}, expert-tp rank {etp}) hold "
                                   f"{flat.numel()} of its {numel} elements")
            shards.append(flat.view(shapes[name]))
        spec = expert_split(name, gated)
        folder = out / "zero" / name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({c.PARAM: join_shards(shards, spec), **how_to_split(spec)}, folder / f"{key}.pt")
    for name, step in steps.items():
        torch.save(step, out / "zero" / name / "step.pt")
    shutil.rmtree(tmp)


@contextlib.contextmanager
def by_global_id(engine):
    """While DeepSpeed's universal loader runs: its ZeRO optimizer knows each expert by the CPLM
    name of its global id (the folder experts_to_universal wrote), other parameters as before."""
    optimizer = engine.optimizer
    names = getattr(optimizer, "param_names", None)
    if not isinstance(names, dict):
        yield
        return
    canonical = canonical_names(engine.module)
    experts = {p: global_expert_name(canonical[n], p) for n, p in engine.module.named_parameters() if _is_expert(p)}
    optimizer.param_names = {**names, **experts}
    try:
        yield
    finally:
        optimizer.param_names = names


def _canonical_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if hasattr(model, "canonical_named_buffers"):  # a pipeline stage
        return dict(model.canonical_named_buffers())
    return dict(model.named_buffers())


def load_expert_bias(model: torch.nn.Module, source: Manifest, cfg) -> None:
    """The routers' expert bias (a buffer: DeepSpeed's universal loader sets parameters only) from
    the saved module states of tp rank 0 (a pipeline's from its layer files); every rank holds it
    whole and equal."""
    biases = {n: b for n, b in _canonical_buffers(model).items() if n.endswith("router.expert_bias")}
    if not biases:
        return
    if source.layout.pp > 1:
        from cplm_dist.checkpoint.loading import pipeline_shards

        saved = pipeline_shards(source, cfg)[0]
    else:
        saved = load_states(model_states_file(source.step_dir, 0))["module"]
    with torch.no_grad():
        for name, bias in biases.items():
            if name not in saved or saved[name].shape != bias.shape:
                raise ReshapeError(f"{source.step_dir}: no router expert bias {name} of shape {tuple(bias.shape)}: "
                                   "the checkpoint holds another model")
            bias.copy_(saved[name])
