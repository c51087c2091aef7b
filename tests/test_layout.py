"""The shape of the library: short functions, short modules, no import cycles (function-level
imports included), tools/ never imported by it. The cycle guard is shown to see a cycle that
hides in a function-level relative import."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "cplm_dist"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500
MAX_TOP_LEVEL_MODULES = 5  # cplm_dist/*.py: the package's own __init__ and what every package may use

# The packages in the order a run's data flows through them, bottom to top: a module may import
# modules of its own package or of a package below it, never above. The modules directly in
# cplm_dist/ (its __init__, errors, files, plotting, megatron_compat: what every package may use)
# sit below them all. That is the whole rule: no module has a place of its own.
PACKAGE_ORDER = ["config", "distributed", "data", "model", "training", "checkpoint", "interop", "evaluation",
                 "profiling", "experiments", "train"]
FOUNDATION = "top level"


def modules(package_dir: Path = LIBRARY) -> dict[str, tuple[ast.Module, bool]]:
    """{dotted module name: (its syntax tree, whether it is a package's __init__)} under package_dir."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        out[name] = (ast.parse(path.read_text(), str(path)), is_package)
    return out


def imported_modules(name: str, tree: ast.Module, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `name` imports anywhere: at the top, inside functions, classes,
    try blocks or `if TYPE_CHECKING`; relative imports resolved against the module's package.
    `from a import b` is an import of a, and of a.b where that is a module. The implicit import of
    a parent package (importing a.b runs a/__init__ first) is not counted: an __init__ that
    re-exports its submodules would otherwise be in a cycle with each of them."""
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in known and m != name}


def import_graph(mods: dict[str, tuple[ast.Module, bool]]) -> dict[str, set[str]]:
    return {name: imported_modules(name, tree, is_package, set(mods)) for name, (tree, is_package) in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def rank_of(name: str) -> int:
    """Module `name`'s rank in the order: 0 for a module directly in cplm_dist/, else 1 + its
    top-level package's index in PACKAGE_ORDER (KeyError: a package PACKAGE_ORDER does not list)."""
    parts = name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in PACKAGE_ORDER and (LIBRARY / f"{parts[1]}.py").is_file()):
        return 0
    if parts[1] not in PACKAGE_ORDER:
        raise KeyError(f"{name}: its package is not in tests/test_layout.py's PACKAGE_ORDER")
    return 1 + PACKAGE_ORDER.index(parts[1])


def place_of(name: str) -> str:
    return ([FOUNDATION] + PACKAGE_ORDER)[rank_of(name)]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a (package) -> b (package)' for every import of a module from a later package."""
    return sorted(f"{a} ({place_of(a)}) -> {b} ({place_of(b)})"
                  for a, targets in graph.items() for b in targets if rank_of(b) > rank_of(a))


def test_imports_run_one_way_down_the_packages():
    graph = import_graph(modules())
    assert all(rank_of(name) >= 0 for name in graph), "every module has a place in the order"
    assert upward_imports(graph) == []


def test_the_order_guard_sees_an_upward_import(tmp_path):
    """A copy of the library with planted upward imports, inside functions (the guard reads every
    import, not only the module's top): the training step from the config, the model from the data."""
    import shutil

    copy = tmp_path / "cplm_dist"
    shutil.copytree(LIBRARY, copy, ignore=shutil.ignore_patterns("__pycache__"))
    graph = import_graph(modules(copy))
    assert upward_imports(graph) == []
    tree = copy / "config" / "tree.py"
    tree.write_text(tree.read_text() + "\n\ndef planted():\n    from cplm_dist.training.step import TrainStep\n    return TrainStep\n")
    assert upward_imports(import_graph(modules(copy))) == ["cplm_dist.config.tree (config) -> cplm_dist.training.step (training)"]
    loader = copy / "data" / "loader.py"
    loader.write_text(loader.read_text() + "\n\ndef planted():\n    from cplm_dist.model.loss import TokenLoss\n    return TokenLoss\n")
    assert upward_imports(import_graph(modules(copy))) == ["cplm_dist.config.tree (config) -> cplm_dist.training.step (training)",
                                                            "cplm_dist.data.loader (data) -> cplm_dist.model.loss (model)"]


def test_the_top_level_holds_a_handful_of_modules():
    top = sorted(p.name for p in LIBRARY.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    packages = {p.name for p in LIBRARY.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(PACKAGE_ORDER) and len(PACKAGE_ORDER) == len(set(PACKAGE_ORDER)), "every package in PACKAGE_ORDER, once"


def test_no_function_is_longer_than_a_screen():
    long = [f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, (tree, _) in modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def test_no_module_is_longer_than_its_budget():
    long = {str(p.relative_to(REPO)): n for p in sorted(LIBRARY.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_import_cycles_and_no_tools():
    mods = modules()
    assert len(mods) > 60 and "cplm_dist.checkpoint" in mods, "the walk must see the whole library"
    for name, (tree, _) in mods.items():
        assert "cplm_dist_tools" not in ast.unparse(tree), f"{name} imports tools/ (the library never does)"
    graph = import_graph(mods)
    # function-level imports are edges too (the walk must see them: one such edge, known to exist)
    assert "cplm_dist.train.driver" in graph["cplm_dist.train"]
    assert find_cycle(graph) is None, "import cycle: " + " -> ".join(find_cycle(graph))


def test_the_cycle_guard_sees_a_cycle_inside_a_function(tmp_path):
    """A synthetic package whose only cycle is a relative import inside a function body (the way
    checkpoint.py <-> reshape.py hid from a guard that read module-level imports only)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..sub.b import g\n    return g()\n")
    (pkg / "sub" / "b.py").write_text("import os\n\n\nclass G:\n    def g(self):\n        from .a import f\n        return f\n")
    (pkg / "c.py").write_text("from pkg.sub.a import f\n")
    graph = import_graph(modules(pkg))
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.a"} and graph["pkg.c"] == {"pkg.sub.a"}
    assert find_cycle(graph) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(modules(pkg))) is None


def test_backbones_and_mixes_are_records_named_once():
    """A backbone's or a mix's name is a record's key and a literal of the config's type, nothing
    else: every other place asks the record for a feature (a third backbone cannot silently get
    Llama's behaviour where a comparison with 'gpt2' was missed)."""
    import typing

    from cplm_dist.config import tree
    from cplm_dist.config.backbones import BACKBONES
    from cplm_dist.model.mixes import MIXES

    assert set(BACKBONES) == set(typing.get_args(tree.Arch)) and set(MIXES) == set(typing.get_args(tree.MixMode))
    records = {*(LIBRARY / "config" / "backbones").glob("*.py"), LIBRARY / "config" / "tree.py"}
    spelled = [f"{p.relative_to(REPO)}:{node.lineno}" for p in sorted(LIBRARY.rglob("*.py")) if p not in records
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Constant) and node.value == "gpt2"]
    assert spelled == []


def test_old_module_paths_import_the_modules_that_hold_them_now():
    """cplm_dist.MOVED: the module paths of the layout before the packages that launch scripts of that
    layout typed (users copied them) import the very module that holds them now and run as
    `python -m OLD`; no old path is a prefix of a module that exists (it would shadow it)."""
    import importlib
    import subprocess
    import sys

    import cplm_dist

    mods = set(modules())
    assert set(cplm_dist.MOVED) == {"cplm_dist.launch_env", "cplm_dist.preflight"}
    for old, new in cplm_dist.MOVED.items():
        assert old not in mods and not any(m.startswith(old + ".") for m in mods), old
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert importlib.import_module(old).__spec__.name == new
    env = {"SLURM_JOB_ID": "7", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "cplm_dist.launch_env", "slurm-port"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, str(20000 + 7 * 8), "")


def test_the_layout_doc_names_every_module_and_tool_as_the_code_says():
    """docs/layout.md (the README's layout table points to it) is what tools/layout_doc.py makes of the
    code now: every module of the library and every tool a line, none without a docstring."""
    from cplm_dist_tools import layout_doc

    doc = (REPO / "docs" / "layout.md").read_text()
    assert doc == layout_doc.render(), "docs/layout.md is out of date: run python tools/layout_doc.py"
    files = sorted(p for p in [*LIBRARY.rglob("*.py"), *(REPO / "tools").glob("*.py")] if "__pycache__" not in p.parts)
    assert len(files) > 100
    missing = [str(p.relative_to(REPO)) for p in files if f"| `{p.relative_to(REPO)}` |" not in doc]
    assert missing == []
    assert "(no docstring)" not in doc
