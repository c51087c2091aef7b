"""Every command the README and docs print stays runnable: each `python tools/X.py ...`,
`python -m cplm_dist...`, `cplm-*`, `torchrun ...` and `launch/*.sh ...` line of their shell code
blocks is parsed by the command's own argument parser (nothing is run: the parse is stopped as it
returns), its config overrides are loaded onto the named config, and a launch script must exist
and know the options given it (`launch/submit.sh` and `launch/submit_preprocess.sh`, which pass
other sbatch options through, print their sbatch lines under --dry-run).

Placeholders are read as a user would fill them: `<...>`, `$VAR` and `$(...)` become a word, an
optional `[--opt value]` group is given, `[overrides]` and a lone `...` (an elision) are left out.
SKIP names the few lines that cannot be parsed so, each with its reason.

The YAML the docs write loads too: a shell block's heredoc into a file that the block then names
(`--config F`: a run config; `--ladder-file F`: a ladder file), and every ```yaml block (a run
config; one without `base:` is a fragment of one, loaded over the run config the docs build on,
`configs/runs/cplm-1.7b.yaml`)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import os
import re
import shlex
import subprocess
import textwrap
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "launch" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # docs/ablation/, docs/scaling/ too
# a fragment of a command line -> why that line is not parsed here
SKIP: dict[str, str] = {
    # none needed today: placeholders are filled as above, other programs' commands (pip, git,
    # lm_eval, sbatch's own options) are not ours to parse
}
PYTHONS = {"python", "python3", ".venv/bin/python", "sudo"}
TORCHRUN = {"torchrun", ".venv/bin/torchrun"}
# an indented (not fenced) line that is a command of ours
INDENTED = r"([A-Z_]+=\S+ )*(sudo )?(python3? |\.venv/bin/(python|torchrun) |torchrun |launch/|bash (tools|launch)/|cplm-)"


class Parsed(BaseException):
    """Raised where a command's parser returns: the command parsed, and nothing after it runs (a
    BaseException, so that no tool's `except Exception` takes it for a failure of its own)."""


@contextlib.contextmanager
def parse_only():
    """ArgumentParser's parse methods stop the program with Parsed(namespace) once the outermost
    parse returns (their own nested calls, and sub-parsers, run as usual)."""
    names = ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args")
    real = {n: getattr(argparse.ArgumentParser, n) for n in names}
    depth = 0

    def stopping(name):
        def call(self, *args, **kwargs):
            nonlocal depth
            depth += 1
            try:
                result = real[name](self, *args, **kwargs)
            finally:
                depth -= 1
            if depth == 0:
                raise Parsed(result)
            return result

        return call

    for n in names:
        setattr(argparse.ArgumentParser, n, stopping(n))
    try:
        yield
    finally:
        for n in names:
            setattr(argparse.ArgumentParser, n, real[n])


def code_lines(path: Path) -> list[tuple[str, str]]:
    """(where, line) of every logical line in the file's shell code blocks (fenced, or indented by
    four spaces and starting with a command of ours), continuations joined."""
    out, fenced, lang, pending, start = [], False, "", "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        if raw.lstrip().startswith("```"):
            fenced, lang = not fenced, raw.strip()[3:].strip()
            continue
        indented = not fenced and raw.startswith("    ") and (pending or re.match(INDENTED, raw.strip()))
        if not indented and (not fenced or lang not in ("", "bash", "sh", "shell", "console")):
            continue
        start = start or number
        line = raw.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((f"{path.relative_to(REPO)}:{start}", pending + line))
        pending, start = "", 0
    return out


def words_of(line: str) -> list[list[str]]:
    """The commands of one shell line (split at ;, &&, ||, |, &), placeholders filled."""
    line = re.sub(r"\$\([^()]*\)", "X", line)                # $(command)
    line = re.sub(r"<[^<>\n]*>", "X", line)                  # <placeholder>
    line = re.sub(r"\$\{?[A-Za-z_][A-Za-z_0-9]*\}?", "X", line)  # $VAR
    line = re.sub(r"(^|\s)\[(-[^\]]*)\]", r"\1\2", line)    # [--opt value]: given
    line = re.sub(r"(^|\s)\[[^\]]*\]", r"\1", line)          # [overrides]: left out
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    commands, current = [], []
    for w in words:
        if w in (";", "&&", "||", "|", "&"):
            commands.append(current)
            current = []
        else:
            current.append(w)
    commands.append(current)
    cleaned = []
    for cmd in commands:
        cmd = [w for i, w in enumerate(cmd) if not (w == "..." and not (i and cmd[i - 1].startswith("-")))]
        cmd = ["X" if w == "..." else w for w in cmd]
        while cmd and (re.fullmatch(r"[A-Z_][A-Z_0-9]*=\S*", cmd[0]) or cmd[0] in ("sudo", "time", "exec", "env")):
            cmd = cmd[1:]
        if ">" in cmd:
            cmd = cmd[:cmd.index(">")]
        cleaned.append(cmd)
    return [c for c in cleaned if c]


SCRIPTS = {name: target.split(":")[0] for name, target in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"].items()}


def checks(cmd: list[str]) -> list[tuple[str, list[str]]]:
    """What to check for one command: ('module', [module, *args]) / ('launch', [script, *args]) /
    ('exists', [path]); [] for a command that is not ours."""
    head, rest = cmd[0], cmd[1:]
    if head in TORCHRUN or (head in PYTHONS and rest[:2] == ["-m", "torch.distributed.run"]):
        return [("torchrun", rest[2:] if head in PYTHONS else rest)]
    if head in PYTHONS:
        if rest[:1] == ["-m"] and len(rest) > 1:
            return [("module", rest[1:])] if rest[1].startswith("cplm_dist") else []
        if rest and rest[0].startswith("tools/") and rest[0].endswith(".py"):
            return [("module", ["cplm_dist_tools." + Path(rest[0]).stem, *rest[1:]])]
        return []
    if head in SCRIPTS:
        return [("module", [SCRIPTS[head], *rest])]
    if head.startswith("launch/"):
        return [("launch", cmd)]
    if head == "bash" and rest and rest[0].startswith(("tools/", "launch/")):
        return [("exists", rest[:1])]
    if head == "sbatch":
        script = next((i for i, w in enumerate(rest) if w.startswith("launch/")), None)
        return [] if script is None else [("exists", [rest[script]]), ("module", ["cplm_dist.train", *rest[script + 1:]])]
    return []


def collected() -> list[tuple[str, str, str, list[str]]]:
    """(where, line, kind, args) of every check the docs call for, SKIP's lines left out."""
    found = []
    for path in DOCS:
        for where, line in code_lines(path):
            if any(fragment in line for fragment in SKIP):
                continue
            found += [(where, line, kind, args) for cmd in words_of(line) for kind, args in checks(cmd)]
    return found


def parse_module(module: str, args: list[str]) -> argparse.Namespace | None:
    """The namespace the module's command line gives `args`; an AssertionError with its message if
    its parser refuses them. Nothing of the command runs past its parse."""
    if module in ("cplm_dist.train", "cplm_dist.train.__main__", "cplm_dist.train.driver"):  # main() sets signal handlers first
        from cplm_dist.train.driver import train_parser

        return checked(lambda: train_parser().parse_intermixed_args(args), module, args)
    if module == "cplm_dist.distributed.launch_env":
        assert args in (["slurm-port"], ["where"]), f"python -m {module} takes slurm-port or where, not {args}"
        return None
    if module == "cplm_dist.evaluation.harness_tasks":
        assert args == [], args
        return None
    target = importlib.import_module(module)
    assert hasattr(target, "main"), f"{module} has no main(): add how to parse it to tests/test_doc_commands.py"
    if not inspect.signature(target.main).parameters:  # a main that reads no command line: it takes no arguments
        assert args == [], f"{module} takes no arguments, given {args}"
        return None
    saved = sys.argv
    sys.argv = [module, *args]
    try:
        return checked(lambda: target.main(args), module, args)
    finally:
        sys.argv = saved


def checked(call, module: str, args: list[str]) -> argparse.Namespace | None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), parse_only():
        try:
            call()
        except Parsed as done:
            result = done.args[0]
            return result[0] if isinstance(result, tuple) else result
        except SystemExit as e:
            assert e.code in (0, None), f"{module} {' '.join(args)}: {err.getvalue().strip()[-500:]}"
            return None
    raise AssertionError(f"{module} {' '.join(args)} ran without parsing a command line")


def check_config(ns) -> None:
    """A parsed `--config C overrides...` loads: every override names a field of the config. A
    YAML path that is neither here nor a shipped name is the reader's own file (`my-1.7b.yaml`)."""
    config, overrides = getattr(ns, "config", None), getattr(ns, "overrides", None)
    if config is None or overrides is None or "X" in config or any("X" in o.split("=")[0] for o in overrides):
        return
    if config.endswith((".yaml", ".yml")) and not (REPO / config).is_file():
        return
    from cplm_dist.config import load_config

    load_config(config, list(overrides))


def launch_options(script: Path) -> set[str]:
    """The options a launch script's `case` takes."""
    found = set()
    for label in re.findall(r"^\s*([-\w|=*]+)\)", script.read_text(), re.M):
        found |= {p.rstrip("*").rstrip("=") for p in label.split("|")}
    return found


def check_launch(args: list[str]) -> None:
    script = REPO / args[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{args[0]} is not an executable script"
    own, train = (args[1:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args[1:], [])
    if script.name in ("submit.sh", "submit_preprocess.sh"):  # other long options pass through to sbatch: let it say
        env = {**os.environ, "PYTHON": "true"}
        proc = subprocess.run([str(script), *own, "--dry-run", "--", *train], env=env, capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 0, proc.stderr
    else:
        known = launch_options(script)
        unknown = [w for w in own if w.startswith("-") and w.split("=")[0] not in known]
        assert not unknown, f"{args[0]} does not take {unknown} (it takes {sorted(known)})"
    if train:
        target = "cplm_dist_tools.preprocess_data" if script.name == "submit_preprocess.sh" else "cplm_dist.train"
        check_config(parse_module(target, train))


def check(kind: str, args: list[str]) -> None:
    if kind == "exists":
        assert (REPO / args[0]).is_file(), f"{args[0]} does not exist"
    elif kind == "launch":
        check_launch(args)
    elif kind == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = checked(lambda: get_args_parser().parse_args(args), "torchrun", args)
        script = ns.training_script
        module = script if ns.module else "cplm_dist_tools." + Path(script).stem
        assert ns.module or (REPO / script).is_file(), f"torchrun runs {script}, which does not exist"
        check_config(parse_module(module, ns.training_script_args))
    else:
        check_config(parse_module(args[0], args[1:]))


def test_every_documented_command_parses():
    checks_made, failed = collected(), []
    for where, line, kind, args in checks_made:
        try:
            check(kind, args)
        except Exception as e:  # noqa: BLE001  (each failure is reported with its line)
            failed.append(f"{where}: {line}\n    {type(e).__name__}: {str(e).strip()[-600:]}")
    assert len(checks_made) > 100, f"only {len(checks_made)} documented commands found: is the extraction broken?"
    assert not failed, f"{len(failed)} of {len(checks_made)} documented commands do not parse:\n" + "\n".join(failed)


def test_the_parse_guard_sees_a_bad_option_and_an_unknown_field():
    """The checks above can fail: an option a tool does not take, and an override naming no field."""
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-option"):
        parse_module("cplm_dist_tools.export_hf", ["--checkpoint", "runs/x", "--out", "hf/x", "--no-such-option"])
    from cplm_dist.errors import ConfigError

    with pytest.raises(ConfigError):
        check_config(parse_module("cplm_dist.train", ["--config", "tiny", "train.no_such_field=1"]))
    assert words_of("python tools/evaluate.py --checkpoint runs/quickstart-<time> [--samples 32] [overrides]  # c") == [
        ["python", "tools/evaluate.py", "--checkpoint", "runs/quickstart-X", "--samples", "32"]]


# --- the YAML the docs write ---------------------------------------------------------------------


FRAGMENT_BASE = "configs/runs/cplm-1.7b.yaml"  # what a YAML fragment of the docs is loaded over


def documented_yaml(path: Path) -> list[tuple[str, str, str]]:
    """(where, kind, text) of the YAML `path` writes (module docstring): kind 'config' or 'ladder'."""
    found, block, lang, start = [], None, "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        if raw.lstrip().startswith("```"):
            if block is None:
                block, lang, start = [], raw.strip()[3:].strip(), number + 1
            else:
                found += yaml_of_block(f"{path.relative_to(REPO)}:{start}", lang, textwrap.dedent("\n".join(block)))
                block = None
        elif block is not None:
            block.append(raw)
    return found


def yaml_of_block(where: str, lang: str, text: str) -> list[tuple[str, str, str]]:
    """A ```yaml block's config; a shell block's heredocs (`cat > F <<'T'` ... `T`) that a later
    line of the block reads as `--config F` or `--ladder-file F`."""
    if lang == "yaml":
        return [(where, "config", text)]
    if lang not in ("", "bash", "sh", "shell"):
        return []
    found = []
    for m in re.finditer(r"cat > ?(\S+) <<-?'?(\w+)'?\n(.*?)\n\2$", text, re.S | re.M):
        name, rest = m.group(1), text[m.end():]
        found += [(f"{where} ({name})", kind, m.group(3)) for option, kind in (("--config", "config"), ("--ladder-file", "ladder"))
                  if re.search(rf"{option}[ =]{re.escape(name)}(\s|$)", rest)]
    return found


def load_documented(kind: str, text: str, tmp_path: Path) -> None:
    """Load one documented YAML as its reader would, from the repository root (where a `base:` of
    `configs/runs/...` resolves); a config fragment without `base:` over FRAGMENT_BASE."""
    import yaml

    file = tmp_path / "documented.yaml"
    if kind == "ladder":
        from cplm_dist.experiments.ladder_recipe import Recipe

        file.write_text(text)
        Recipe.from_file(file)
        return
    data = yaml.safe_load(text)
    assert isinstance(data, dict), f"not a mapping: {type(data).__name__}"
    file.write_text(text if "base" in data else f"base: {FRAGMENT_BASE}\n{text}")
    from cplm_dist.config import load_config

    load_config(file)


def test_every_documented_config_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    found, failed = [y for path in DOCS for y in documented_yaml(path)], []
    for where, kind, text in found:
        try:
            load_documented(kind, text, tmp_path)
        except (Exception, SystemExit) as e:  # noqa: BLE001  (each failure is reported with its block)
            failed.append(f"{where} ({kind}): {type(e).__name__}: {str(e).strip()[-600:]}")
    kinds = {kind for _, kind, _ in found}
    assert len(found) >= 8 and kinds == {"config", "ladder"}, f"found {[(w, k) for w, k, _ in found]}: is the extraction broken?"
    assert not failed, f"{len(failed)} of {len(found)} documented YAML blocks do not load:\n" + "\n".join(failed)


def test_the_yaml_check_sees_a_heredoc_and_a_bad_field(tmp_path):
    block = "cat > l.yaml <<'YAML'\nrules: {lr: width}\nYAML\npython tools/scaling.py --ladder-file l.yaml\ncat > unread.yaml <<'YAML'\na: 1\nYAML"
    assert yaml_of_block("x:1", "bash", block) == [("x:1 (l.yaml)", "ladder", "rules: {lr: width}")]
    from cplm_dist.errors import ConfigError, UsageError

    with pytest.raises(ConfigError):
        load_documented("config", "train:\n  no_such_field: 1\n", tmp_path)
    with pytest.raises(UsageError):
        load_documented("ladder", "rules: {no_such_rule: 1}\n", tmp_path)
