"""Loading a config: YAML, `base:` chains, dotted command-line overrides, typed into the tree.

    cfg = load_config("configs/models/tiny.yaml", ["model.num_layers=4", "copy.mix=joint"])

A YAML file may start from another with `base: <path or name>` (resolved next to the file, then
in the shipped `configs/`); its own keys override the base's. The data mixture is one thing:
a file that sets data.stages over a base that sets data.blend (or data.blend over inherited
data.stages) replaces the inherited one, said once (cplm_dist.config.notes); both set in one file
is refused. train.train_tokens and data.stages[].from_tokens become steps here
(cplm_dist.config.budget). Every error is a `ConfigError`
whose message is one line naming the field, the value and what would be valid; entry points turn
it into exit code 2. The tree is cplm_dist.config.tree; `load_config` validates it
(cplm_dist.config.validation).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from cplm_dist.config.budget import resolve_token_budget
from cplm_dist.config.notes import say_once
from cplm_dist.config.tree import Config
from cplm_dist.config.validation import validate
from cplm_dist.errors import ConfigError

# The shipped configs: the repository's configs/ in a checkout (and an editable install); an
# installed wheel carries them as package data in cplm_dist/configs.
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
CONFIG_DIR = next((d for d in (_PACKAGE_DIR / "configs", _PACKAGE_DIR.parent / "configs") if d.is_dir()),
                  _PACKAGE_DIR.parent / "configs")

FLOAT32_MAX = 3.4028234663852886e38  # parameters and optimizer states are float32: larger numbers cannot work


def resolve_config_path(name: str | Path, relative_to: Path | None = None) -> Path:
    """A path as given, next to `relative_to`, or a shipped config by name (`tiny`, `cplm-135m`)."""
    name = str(name)
    candidates = [Path(name)]
    if relative_to is not None:
        candidates.append(relative_to / name)
    for sub in ("", "models"):
        base = CONFIG_DIR / sub
        candidates += [base / name, base / f"{name}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    shipped = sorted(p.stem for p in CONFIG_DIR.rglob("*.yaml"))
    raise ConfigError(f"config '{name}' not found: give a YAML path or one of {shipped}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config {path}: 'base' chain loops back to itself")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except ConfigError as e:
        raise ConfigError(f"config {path} {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {path}: not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config {path}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config {path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    inherited = _read_yaml(resolve_config_path(base, path.parent), seen + (path,))
    return _merge(_one_mixture(inherited, data, path), data)


def _one_mixture(inherited: dict, data: Mapping, path: Path) -> dict:
    """`inherited` without its data.blend where `data` (the file over it) sets data.stages, and
    without its data.stages where `data` sets data.blend: the derived file's mixture wins."""
    mine, theirs = data.get("data"), inherited.get("data")
    if not isinstance(mine, Mapping) or not isinstance(theirs, dict):
        return inherited
    for given, other in (("stages", "blend"), ("blend", "stages")):
        if mine.get(given) and theirs.get(other) and other not in mine:
            say_once(f"config {path} sets data.{given} over the data.{other} of its base: the inherited data.{other} "
                     "is dropped (the derived file's mixture wins)")
            return {**inherited, "data": {k: v for k, v in theirs.items() if k != other}}
    return inherited


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key '{key}' is given twice: keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _merge(base: dict, over: Mapping) -> dict:
    """`over` on top of `base`; an empty section (`model:` with nothing under it) changes nothing."""
    out = dict(base)
    for k, v in over.items():
        if v is None and isinstance(out.get(k), dict):
            continue
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`model.num_layers=4` -> (["model", "num_layers"], 4); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' must look like section.field=value (e.g. model.num_layers=4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    data = _merge({}, data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path_or_name: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read YAML (or start from the defaults when None), apply dotted overrides, validate."""
    data = {} if path_or_name is None else _read_yaml(resolve_config_path(path_or_name))
    given = apply_overrides(data, overrides)
    cfg = from_dict(given)
    resolve_token_budget(cfg, given)
    validate(cfg)
    return cfg


def from_dict(data: Mapping, cls: type = Config, prefix: str = "") -> Any:
    """Build a dataclass tree from plain data, refusing unknown keys and wrongly typed values."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(data, Mapping):
        name = prefix.rstrip(".") or "config"
        raise ConfigError(f"{name} must be a mapping, got {data!r}" + (
            f": give its keys, e.g. {name}.{next(iter(known))}=..." if prefix else ""))
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f"; valid keys: {sorted(known)}"
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(value if value is not None else {}, hint, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_type(f"{prefix}{key}", value, hint)
    missing = [f.name for f in known.values()
               if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} lacks required key '{prefix}{missing[0]}'")
    return cls(**kwargs)


def _check_type(name: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{name}={value!r} is not valid: choose one of {list(typing.get_args(hint))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        words = [w for arg in args if typing.get_origin(arg) is Literal for w in typing.get_args(arg)]
        also = f" or one of {words}" if words and len(errors) > 1 else ""  # data.blend[].weight: a number or 'tokens'
        raise ConfigError(errors[0] + also if errors else f"{name}={value!r} has the wrong type")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}={value!r} must be a list")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        if dataclasses.is_dataclass(item):
            return [from_dict(v, item, f"{name}[{i}].") for i, v in enumerate(value)]
        return [_check_type(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):  # an optional mapping (model.rope_scaling)
        return from_dict(value, hint, f"{name}.")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}={value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}={value!r} must be a number")
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise ConfigError(f"{name}={value!r} must be a finite number (within float32's range, |x| < 3.4e38)")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} must be a string")
        return value
    return value
