"""The shape of the library: short functions, no import cycles, tools/ never imported by it."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "cplm_dist"
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def test_no_function_is_longer_than_a_screen():
    long = [f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, tree in modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def module_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """cplm_dist modules `name` imports at import time (top level, not inside functions)."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m in known and m != name}


def test_no_import_cycles_and_no_tools():
    mods = modules()
    graph = {name: module_imports(name, tree, set(mods)) for name, tree in mods.items()}
    for name, tree in mods.items():
        text = ast.unparse(tree)
        assert "cplm_dist_tools" not in text, f"{name} imports tools/ (the library never does)"
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(node, path):
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
