"""The shape of the code: imports run one way through the layers, and functions stay readable.

Layers, lowest first (docs/architecture.md):
  0 shared types, model, memory, scheduling
  1 pipeline (an executor the engine drives)
  2 engine
  3 serving, sim, tune, bench
  4 cli
A module imports only from its own layer or lower; packages of one layer form no cycle; nobody
imports another module's `_private` names. Every import counts, including those inside functions.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "charioteer"
LAYERS = {
    "config": 0, "request": 0, "sampling_params": 0, "outputs": 0, "runtime": 0, "parallel": 0,
    "model": 0, "memory": 0, "scheduling": 0,
    "pipeline": 1,
    "engine": 2,
    "serving": 3, "sim": 3, "tune": 3, "bench": 3,
    "cli": 4,
}
READABLE = ("engine", "scheduling", "sim", "serving", "model")  # the "no function over ~60 lines"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _unit(module: str) -> str:
    """The layer unit of a module: charioteer.<package or top-level module>. A `__main__` entry
    point (python -m charioteer.pipeline) is a command line like cli."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "cli"
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, module: str):
    """(imported module, imported names) for every import statement in the file."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, [a.name for a in node.names]


def _graph():
    edges = []
    for module, path in _modules().items():
        for target, names in _imports(path, module):
            if target == "charioteer" or target.startswith("charioteer."):
                edges.append((module, target, names))
    return edges


def test_every_package_has_a_layer():
    units = {_unit(m) for m in _modules()} - {""}
    assert units <= set(LAYERS), f"give these a layer: {sorted(units - set(LAYERS))}"


def test_imports_run_upward_only():
    bad = []
    for source, target, _ in _graph():
        s, t = _unit(source), _unit(target)
        if not s or not t:
            continue  # the package root re-exports the public API
        if LAYERS[t] > LAYERS[s]:
            bad.append(f"{source} (layer {LAYERS[s]}) imports {target} (layer {LAYERS[t]})")
    assert not bad, "lower layers must not import higher ones:\n" + "\n".join(bad)


def test_no_import_cycles_between_packages():
    graph = defaultdict(set)
    for source, target, _ in _graph():
        s, t = _unit(source), _unit(target)
        if s and t and s != t:
            graph[s].add(t)
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(" -> ".join(stack[stack.index(node):] + [node]))
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        stack.pop()

    for node in sorted(graph):
        visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_names_imported_from_other_modules():
    bad = [f"{source} imports {n} from {target}" for source, target, names in _graph()
           for n in names if n.startswith("_") and not n.startswith("__") and target != source]
    assert not bad, "\n".join(bad)


OWNERS = ("engine", "scheduling")  # engine and scheduler state is written only here
_STATE = re.compile(r"(^|\.)(engine|scheduler|sched|runner|blocks|executor)(\.|$)|^(request|req)$")


def test_only_the_engine_writes_engine_and_request_state():
    """Observers read the step record; they never patch engine methods or write request state."""
    bad = []
    for module, path in _modules().items():
        if _unit(module) in OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and _STATE.search(ast.unparse(t.value)):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {ast.unparse(t)} = ...")
    assert not bad, "only engine/ and scheduling/ may write this state:\n" + "\n".join(bad)


def test_functions_stay_readable():
    long = []
    for module, path in _modules().items():
        if _unit(module) not in READABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_checks_catch_a_violation(tmp_path):
    """The walker sees imports inside functions and resolves relative ones (a check that cannot fail is no check)."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from charioteer.serving import api\n    from .base import _private\n")
    found = list(_imports(path, "charioteer.scheduling.x"))
    assert ("charioteer.serving", ["api"]) in found
    assert ("charioteer.scheduling.base", ["_private"]) in found
