"""The layers keep their promises: the core (`fleet/`) imports nothing from Prefect or the
layers above it, and no module imports itself back through another.

The imports are read from the source (ast), at module level and inside functions alike;
only `if TYPE_CHECKING:` blocks are left out (they never run). A relative import and
`from pkg import module` both resolve to the module they name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fleet", "flows", "tasks", "blocks")
ABOVE_THE_CORE = ("prefect", "flows", "tasks", "blocks")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: not under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(mod: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    """The dotted names an import statement reaches (a package's `from p import m` reaches p.m too)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    return [name] + [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in mods]


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the project modules it imports, and every import from the core to a layer above it)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    back: list[str] = []
    for mod, path in mods.items():
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(mod, path, node, mods):
                if mod.split(".")[0] == "fleet" and target.split(".")[0] in ABOVE_THE_CORE:
                    back.append(f"{mod} (line {node.lineno}) imports {target}")
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph, back


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_core_imports_nothing_from_prefect_or_the_layers_above() -> None:
    """Fault: fleet/node/ssh.py loaded Prefect blocks itself and fleet/cli.py imported the flows, so
    the core could not run, be tested or be reused without Prefect, as the design promises."""
    _, back = import_graph()
    assert back == []


def test_no_import_cycles() -> None:
    """Fault: fleet/cli.py and fleet/demo.py imported each other, fleet/config.py and the engine
    profiles too, tasks/bringup.py and tasks/teardown.py too, and the generation modules through
    generation/job/remote.py (hidden by function-level imports), so none of them could be read,
    tested or moved on its own."""
    graph, _ = import_graph()
    assert cycles(graph) == []


def test_the_walk_sees_function_level_imports_and_cycles(tmp_path: Path) -> None:
    """The checker itself: an import inside a function counts, one under TYPE_CHECKING does not."""
    tree = ast.parse("def f():\n    import prefect\nif TYPE_CHECKING:\n    import flows\n")
    assert [n.names[0].name for n in _runtime_imports(tree)] == ["prefect"]  # type: ignore[union-attr]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
