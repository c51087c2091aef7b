"""Reshape on resume: a checkpoint saved at one layout (tp, pp and its schedule, cp, dp, ZeRO stage,
a sparse model's ep and expert_tp) continues at another,
carrying the fp32 master weights, AdamW's moments and step, the schedule and the data position.

The go-between is DeepSpeed's universal checkpoint: one directory per parameter holding its full,
tp- and dp-independent fp32 weight and moments,

    <tmp>/zero/<CPLM parameter name>/{fp32,exp_avg,exp_avg_sq,step}.pt    + zero/optimizer_state.pt

Pipeline stages name their parameters by DeepSpeed's layer index; every save records those names,
their CPLM names and their tp split for the whole model (cplm_dist.checkpoint.parameter_record), so
the folders are renamed to the CPLM names after conversion and linked under the names the loading
engine's stages give them before loading (`link_names`): any pp (and schedule) reads any other.

1. **To universal** (rank 0, once). Under ZeRO 1-3 DeepSpeed's own converter
   (`deepspeed.checkpoint.ds_to_universal`) joins the ZeRO shards and then the tp shards, told how
   by the parameter layout every save records (`universal_info`: vocabulary rows and their
   unpadded size, row-parallel splits, SwiGLU's two sub-parameters, replicated tensors, a
   pipeline's tied copy). A sparse model's experts are left out of what that converter reads
   and converted by global expert id from their own ZeRO partitions
   (cplm_dist.checkpoint.reshape_experts), so any ep reads any other. ZeRO-0 checkpoints hold a plain torch AdamW state per tp rank (and
   stage), which that converter does not read (it reads ZeRO optimizer shards only):
   `_zero0_to_universal` writes the same files from them (a pipeline's weights from its layer
   files) with our shard layout (cplm_dist.model.parallel.sharding). The other ranks wait for it
   on a marker file, not in a collective (cplm_dist.checkpoint.rank_zero_work): the wait is
   bounded by `train.reshape_timeout_minutes` (120), not by `train.collective_timeout_minutes`.
2. **From universal** (`load_reshaped`, every rank). ZeRO 1-3 engines load it themselves
   (`checkpoint.load_universal` in their DeepSpeed config, cplm_dist.training.engine): every rank cuts its
   tp shard and its ZeRO partition, and reads its own experts by their global ids; the routers'
   expert bias (a buffer, which the universal loaders do not set) comes from the saved module states.
   A ZeRO-0 engine has no such loader (its optimizer is our AdamW), so `load_zero0` takes each
   parameter's shard with our layout and sets the weights, moments and step itself.

Which layouts may reshape is checked before any process starts (manifest.check_reshape). The
schedule, the loader position and the counters are not sharded: they come from the saved
tp rank 0's model states (DeepSpeed keeps them there) and are global (the loader position is
the number of samples consumed by all ranks), so a new dp reads on where the old one stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.checkpoint.manifest import Layout, Manifest, ReshapeError
from cplm_dist.checkpoint.parameter_record import (EXPERT_PARAMETERS, PARAMETERS, UNIVERSAL_INFO, canonical_names,
                                                   how_to_split, spec_from_json, universal_info)
from cplm_dist.checkpoint.rank_zero_work import rank_zero_does
from cplm_dist.checkpoint.reshape_experts import by_global_id, experts_to_universal, load_expert_bias, without_experts
from cplm_dist.checkpoint.safe_io import (load_states, model_states_file, model_states_name, os_error, safe_load,
                                          weights_only_torch_load)
from cplm_dist.config import Config
from cplm_dist.errors import CheckpointError
from cplm_dist.megatron_compat import import_deepspeed
from cplm_dist.model.layer_shapes import muon_shape, muon_shapes
from cplm_dist.model.moe_naming import expert_of
from cplm_dist.model.parallel.sharding import full_shape, join_shards, spec_of, take_shard
from cplm_dist.training.expert_groups import saved_as_dense
from cplm_dist.training.optim import parameter_groups

log = logging.getLogger(__name__)
FAULT_SLOW_RESHAPE = "CPLM_FAULT_SLOW_RESHAPE_S"  # fault injection (tests): rank 0 converts this many seconds slower

def to_universal(source: Manifest, out: Path, model: torch.nn.Module, cfg: Config) -> None:
    """Write the universal form of the checkpoint `source` into `out` (removed first), every
    parameter's folder under its CPLM name: DeepSpeed's converter under ZeRO 1-3, ours for ZeRO-0.
    Rank 0 only."""
    step_dir, saved = source.step_dir, source.layout
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    states = {p: None for p in _model_states_files(step_dir)}
    first = states[next(iter(states))] = load_states(next(iter(states)))
    if saved.pp > 1 and PARAMETERS not in first:
        raise ReshapeError(f"{step_dir} is a pipeline checkpoint saved before cplm_dist recorded its parameter names: "
                           f"resume it at its layout ({saved}) without --reshape, then save again to reshape")
    if saved.zero_stage == 0:
        _zero0_to_universal(source, out, model, cfg, {p: s or load_states(p) for p, s in states.items()})
        _readable_by_every_stage(out, cfg)
        return
    experts = first.get(EXPERT_PARAMETERS)  # a sparse model's expert partitions (cplm_dist.checkpoint.reshape_experts)
    sparse = cfg.model.moe.num_experts > 0 and saved.zero_stage in (1, 2)
    if sparse and experts is None:
        raise ReshapeError(f"{step_dir} is a sparse checkpoint saved before cplm_dist recorded its experts' ZeRO "
                           f"partitions: resume it at its layout ({saved}) without --reshape, then save again to reshape")
    del first, states
    import_deepspeed()
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(step_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    # the layout where a save lacks it; the experts are converted apart (below), by global id
    with quiet[0], quiet[1], trusted_torch_load(universal_info(model), drop_experts=sparse):
        ds_to_universal.main(args)
    (out.parent / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; we name `out` ourselves
    for f in out.glob("layer_*-model_states.pt"):  # pipeline layer files: the weights are in zero/
        f.unlink()
    names = (safe_load(model_states_file(out, 0), map_location="cpu").get(PARAMETERS) or {}).get("names", {})
    for saved_name, name in names.items():  # a pipeline's DeepSpeed names -> CPLM names
        if saved_name != name and (out / "zero" / saved_name).is_dir():
            (out / "zero" / saved_name).rename(out / "zero" / name)
    if sparse:
        experts_to_universal(step_dir, out, experts, cfg.model)
    _momentum_folders(out, model, cfg)
    _readable_by_every_stage(out, cfg)


def _model_states_files(step_dir: Path) -> list[Path]:
    """The checkpoint's model-states files, one per model-parallel rank (tp x pp), in rank order."""
    ranks = sorted({int(m.group(1)) for p in step_dir.iterdir() if (m := _MP_STATES.search(p.name))})
    return [model_states_file(step_dir, r) for r in ranks]


_MP_STATES = re.compile(r"(?:^|_)mp_rank_(\d+)_model_states\.pt$")


def link_names(universal: Path, names: dict[str, str]) -> None:
    """Each parameter's folder also under the name the loading engine gives it ({engine name: CPLM
    name}; a pipeline stage's DeepSpeed names), as DeepSpeed's universal loader looks it up."""
    for engine_name, name in names.items():
        link = universal / "zero" / engine_name
        if engine_name != name and not link.exists():
            link.symlink_to(name, target_is_directory=True)


def _readable_by_every_stage(out: Path, cfg: Config) -> None:
    """DeepSpeed's ZeRO-1/2 and ZeRO-3 universal loaders read different fields, and its
    converter writes those of the stage it read: the ZeRO-1/2 loader wants `ds_version`,
    `clip_grad` and `param_groups` at the top of zero/optimizer_state.pt and a step.pt per
    parameter; the ZeRO-3 loader wants the step and groups inside `optimizer_state_dict`, and
    the model states under ZeRO-3's file name. Both are written, so any stage loads any."""
    import deepspeed

    path = out / "zero" / "optimizer_state.pt"
    sd = safe_load(path, map_location="cpu")
    inner = sd.get("optimizer_state_dict") or {}
    groups = sd.get("param_groups") or inner.get("param_groups")
    folders = [p for p in (out / "zero").iterdir() if p.is_dir()]
    step = inner.get("state", {}).get(0, {}).get("step")
    if step is None:
        step = next(safe_load(p / "step.pt") for p in folders if (p / "step.pt").is_file())
    sd.update(param_groups=groups, ds_version=sd.get("ds_version", deepspeed.__version__),
              clip_grad=sd.get("clip_grad", cfg.optim.clip_grad),
              optimizer_state_dict={**inner, "state": inner.get("state") or {0: {"step": step}}, "param_groups": groups})
    torch.save(sd, path)
    for folder in folders:
        moments = (folder / "exp_avg.pt").is_file() or (folder / "momentum_buffer.pt").is_file()
        if moments and not (folder / "step.pt").is_file():
            torch.save(step, folder / "step.pt")
    for have in _model_states_files(out):
        r = int(_MP_STATES.search(have.name).group(1))
        names = [out / model_states_name(r), out / model_states_name(r, zero3=True)]
        for p in names:
            if not p.exists():
                os.link(have, p)


def trusted_torch_load(info: dict | None = None, drop_experts: bool = False):
    """While DeepSpeed's converter and universal loader run, their torch.load reads through the
    checkpoint allow-list (safe_io.weights_only_torch_load). megatron-core's layers
    save an `_extra_state` of None in the module states, which the converter would copy as a weight
    (None.float()): those entries are left out of what it reads. `info`: the layout for model
    states saved without one (by cplm_dist before reshaping existed). `drop_experts`: the converter
    sees no expert (reshape_experts.without_experts: ours converts them)."""

    def clean(obj):
        _momentum_as_moments(obj)
        if isinstance(obj, dict) and isinstance(obj.get("module"), dict):
            obj["module"] = {k: v for k, v in obj["module"].items() if v is not None}
            if info is not None:
                obj.setdefault(UNIVERSAL_INFO, info)
        if drop_experts:
            without_experts(obj)
        return obj

    return weights_only_torch_load(clean)


def _momentum_as_moments(obj) -> None:
    """Muon's ZeRO shards through DeepSpeed's converter, which reads exp_avg and exp_avg_sq from
    every group's flat state: a group holding Muon's momentum_buffer alone lends it as exp_avg
    (and zeros as exp_avg_sq); `_momentum_folders` names the files back after conversion."""
    inner = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    state = (inner.get("base_optimizer_state") or {}).get("state") if isinstance(inner, dict) else None
    for flat in (state or {}).values():
        if "momentum_buffer" in flat and "exp_avg" not in flat:
            flat["exp_avg"], flat["exp_avg_sq"] = flat["momentum_buffer"], torch.zeros_like(flat["momentum_buffer"])


def _momentum_folders(out: Path, model: torch.nn.Module, cfg: Config) -> None:
    """After DeepSpeed's converter: each Muon matrix's exp_avg.pt is its momentum_buffer.pt."""
    if cfg.optim.name != "muon":
        return
    canonical = canonical_names(model)
    shapes = muon_shapes(cfg.model, cfg.copy if cfg.optim.muon.copy_head else None)
    for own_name, _ in model.named_parameters():
        name = canonical[own_name]
        folder = out / "zero" / name
        if muon_shape(name, shapes) is not None and (folder / "exp_avg.pt").is_file():
            (folder / "exp_avg.pt").rename(folder / "momentum_buffer.pt")
            (folder / "exp_avg_sq.pt").unlink(missing_ok=True)


def _zero0_to_universal(source: Manifest, out: Path, model: torch.nn.Module, cfg: Config, states: dict) -> None:
    """Universal files from a ZeRO-0 checkpoint: every saved tp rank's weights (a pipeline's from
    its layer files) and torch AdamW state (each model-states file's, indexed in its parameter-group
    order) joined by our layout. `states`: {model-states file: its contents}."""
    from deepspeed.checkpoint import constants as c

    from cplm_dist.checkpoint.loading import pipeline_shards

    saved = source.layout
    records = [s.get(PARAMETERS) for s in states.values()]
    if saved.pp > 1:
        weights = pipeline_shards(source, cfg)
    else:
        weights = [s["module"] for s in states.values()]
    if records[0] is not None:
        specs = {name: spec_from_json(v) for name, v in records[0]["specs"].items()}
    elif hasattr(model, "canonical_named_parameters"):  # saved by an earlier cplm_dist, read at pp > 1
        raise ReshapeError(f"{source.step_dir} (ZeRO-0) was saved before cplm_dist recorded its parameter order: "
                           "reshape it to a layout without pipeline stages first (parallel.pp=1)")
    else:
        specs = {name: spec_of(p) for name, p in model.named_parameters()}
    slots = [{} for _ in range(saved.tp)]  # per tp rank {CPLM name: AdamW state}
    for i, (state, record) in enumerate(zip(states.values(), records)):
        if record is None:
            by_id = {id(p): n for n, p in model.named_parameters()}
            order, tp_rank = [by_id[id(p)] for g in parameter_groups(model, cfg) for p in g["params"]], i
        else:
            order, tp_rank = record["order"], record["tp_rank"]
        for index, name in enumerate(order):
            slots[tp_rank].setdefault(name, state["optimizer"]["state"].get(index, {}))
    for name, spec in specs.items():
        per_state = {"fp32": [w[name].float() for w in weights]}
        mine = [slot.get(name, {}) for slot in slots]
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):  # AdamW's moments, Muon's momentum
            if all(key in s for s in mine):
                per_state[key] = [s[key] for s in mine]
        folder = out / "zero" / name
        folder.mkdir(parents=True)
        for key, shards in per_state.items():
            full = join_shards(shards, spec) if spec.is_split else sum(shards) / len(shards)
            torch.save({c.PARAM: full[: spec.full_rows] if spec.full_rows else full, **how_to_split(spec)}, folder / f"{key}.pt")
        if all("step" in s for s in mine):
            torch.save(mine[0]["step"], folder / "step.pt")
    import deepspeed

    first = next(iter(states.values()))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in first["optimizer"]["param_groups"]]
    torch.save({"param_groups": groups, "ds_version": deepspeed.__version__, "clip_grad": cfg.optim.clip_grad},
               out / "zero" / "optimizer_state.pt")
    for path in states:  # the schedule and our client state, read from the model states
        shutil.copy2(path, out / path.name)


def load_zero0(universal: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, tp_rank: int,
               tp_size: int) -> dict:
    """This rank's tp shard of every parameter's universal fp32 weight and moments into a ZeRO-0
    run's model and AdamW, and the schedule (our loader: DeepSpeed's needs a ZeRO optimizer).
    Returns the saved client state."""
    names = canonical_names(model)
    with torch.no_grad():
        for engine_name, param in model.named_parameters():
            name = names[engine_name]
            spec, folder = spec_of(param), universal / "zero" / name
            if not (folder / "fp32.pt").is_file():
                raise ReshapeError(f"{universal}: no weights for {name}: the checkpoint holds another model")
            want = full_shape(param.shape, spec, tp_size)

            def shard(key: str) -> torch.Tensor:
                full = safe_load(folder / f"{key}.pt", map_location="cpu")["param"]
                if spec.full_rows and full.shape[0] < want[0]:
                    full = torch.cat([full, full.new_zeros(want[0] - full.shape[0], *full.shape[1:])])
                if tuple(full.shape) != want:
                    raise ReshapeError(f"{universal}: {name} has shape {tuple(full.shape)}, the model needs {want}")
                return take_shard(full, spec, tp_rank, tp_size).to(param.device, torch.float32).contiguous()

            param.copy_(shard("fp32"))
            keys = [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer") if (folder / f"{k}.pt").is_file()]
            if keys:  # AdamW's moments or Muon's momentum
                step = safe_load(folder / "step.pt", map_location="cpu")
                optimizer.state[param] = {"step": torch.as_tensor(float(step), dtype=torch.float32),
                                          **{k: shard(k) for k in keys}}
    states = safe_load(model_states_file(universal, 0), map_location="cpu")
    scheduler.load_state_dict(states["lr_scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    return states


def load_reshaped(engine, source: Manifest, cfg: Config, dims) -> dict:
    """Load `source`, saved at another layout, into `engine`: rank 0 writes its universal form
    into out_dir/.reshape-<tag>; every rank loads its part (DeepSpeed's universal loader under
    ZeRO > 0, `load_zero0` at ZeRO-0); the transient copy is removed. Returns the client state."""
    saved, tmp = source.layout, Path(cfg.train.out_dir) / f".reshape-{source.tag}"
    start = time.perf_counter()
    names = [None] * dims.world_size  # every stage's parameter names, under which its engine loads them
    # (experts apart: the same local name is another expert on each ep rank, loaded by global id)
    dist.all_gather_object(names, {k: v for k, v in canonical_names(engine.module).items() if expert_of(k) is None})
    marker = tmp.with_name(tmp.name + ".done")

    def convert() -> str | None:
        _slow_down_for_tests()
        return os_error(lambda: (to_universal(source, tmp, engine.module, cfg),
                                 link_names(tmp, {k: v for part in names for k, v in part.items()})), tmp.parent)

    try:  # the others wait on a marker file, bounded by train.reshape_timeout_minutes, not by the collective timeout
        error = rank_zero_does(convert, marker, dims.rank, dims.world_size, cfg.train.reshape_timeout_minutes,
                               f"converting {source.step_dir} ({saved}) for this layout")
        if error:
            raise CheckpointError(f"converting {source.step_dir} ({saved}) for this layout failed: {error}")
        client_state = _load_universal(engine, tmp, cfg, dims, source)
        dist.barrier()
    finally:
        if dims.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            marker.unlink(missing_ok=True)
    log.info(f"reshaped {source.step_dir} from {saved} to {Layout.of(cfg, dims.tp_size, dims.dp_size)} "
             f"in {time.perf_counter() - start:.1f}s")
    return client_state


def _slow_down_for_tests() -> None:
    """Fault injection (tests): rank 0's conversion takes CPLM_FAULT_SLOW_RESHAPE_S seconds longer."""
    time.sleep(float(os.environ.get(FAULT_SLOW_RESHAPE, "0") or 0))


def _load_universal(engine, universal: Path, cfg: Config, dims, source: Manifest) -> dict:
    # the config's optimizer settings per group (DeepSpeed's ZeRO-3 loader gives every group the
    # first group's, weight decay included); the learning rate is the schedule's
    settings = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in engine.optimizer.param_groups]
    if cfg.train.zero_stage > 0:
        with trusted_torch_load(), saved_as_dense(engine), by_global_id(engine):  # experts by global id
            path, client_state = engine.load_checkpoint(str(universal.parent), tag=universal.name, load_optimizer_states=True,
                                                        load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the universal form of {source.step_dir}")
    else:
        client_state = load_zero0(universal, engine.module, engine.optimizer, engine.lr_scheduler, dims.tp_rank, dims.tp_size)
    load_expert_bias(engine.module, source, cfg)  # a buffer: the loaders above set parameters only
    for group, kept, lr in zip(engine.optimizer.param_groups, settings, engine.lr_scheduler.get_last_lr()):
        group.update(kept, lr=lr)
    # DeepSpeed's ZeRO-3 loader hands every group one and the same step tensor, which AdamW would
    # then advance once per group and step
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    return client_state
