"""The layers keep their promises: the core (`fleet/`) imports nothing from Prefect or the
layers above it, and no module imports itself back through another.

The imports are read from the source (ast), at module level and inside functions alike;
only `if TYPE_CHECKING:` blocks are left out (they never run). A relative import and
`from pkg import module` both resolve to the module they name.
"""

from __future__ import annotations

import ast
import sys
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


# -- which way the arrows point ---------------------------------------------------------------------
# Every import statement counts here, deferred (inside a function) and `if TYPE_CHECKING:` alike: an
# arrow that only a type checker follows still tells a reader that the lower module knows the upper.

LAYERS = ("fleet", "blocks", "tasks", "flows")          # each imports only those before it
GEN_ROOMS = ("data", "hotpath", "job", "multinode")     # fleet/generation/'s rooms, the same rule
CORE_ENTRY = ("fleet.cli",)                             # the commands: over bring-up and generation alike


def _every_import(path: Path) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, (ast.Import, ast.ImportFrom))]


def arrows() -> list[tuple[str, int, str]]:
    """(module, line, project module it names) for every import in the project."""
    mods = _modules()
    out = []
    for mod, path in mods.items():
        for node in _every_import(path):
            for target in _targets(mod, path, node, mods):
                if target.split(".")[0] in PACKAGES:
                    out.append((mod, node.lineno, target))
    return out


def _room(mod: str) -> int | None:
    parts = mod.split(".")
    return GEN_ROOMS.index(parts[2]) if parts[:2] == ["fleet", "generation"] and len(parts) > 2 \
        and parts[2] in GEN_ROOMS else None


def test_every_arrow_points_down_the_layers() -> None:
    """Fault: tasks/revalidate.py imported flows.outcome — the task layer reaching into the flow layer
    (and blocks/ must not lean on tasks or flows either). Deferred and TYPE_CHECKING imports count."""
    up = [f"{m} (line {n}) imports {t}" for m, n, t in arrows()
          if LAYERS.index(t.split(".")[0]) > LAYERS.index(m.split(".")[0])]
    assert up == []


def test_bring_up_does_not_reach_into_generation() -> None:
    """Fault: fleet/servers.py imported fleet.generation.remote (deferred) to learn which servers a live
    job uses, and fleet/smoke.py the answer schema from generation — bring-up depending on the
    generation layer. Both questions are the core's now (fleet/jobs.py, fleet/answer.py); only the
    CLI, which has commands for both, imports generation."""
    reach = [f"{m} (line {n}) imports {t}" for m, n, t in arrows()
             if m.startswith("fleet.") and not m.startswith("fleet.generation") and m not in CORE_ENTRY
             and t.startswith("fleet.generation")]
    assert reach == []


def test_generation_rooms_import_only_the_rooms_above_them() -> None:
    """Fault: fleet/generation/ was one flat room of 36 modules where the data layer named the
    dispatcher (manifest.py's Summary) and job.json's record the job checks (params_diff). The rooms
    are data < hotpath < job < multinode (fleet/generation/__init__.py): the data layer imports no
    hot-path module, the hot path no job or multi-node module, a single job no multi-node module."""
    assert {p.name for p in (ROOT / "fleet" / "generation").iterdir() if p.is_dir() and p.name != "__pycache__"} \
        == set(GEN_ROOMS)
    assert not [p for p in (ROOT / "fleet" / "generation").glob("*.py") if p.name != "__init__.py"]
    wrong = [f"{m} (line {n}) imports {t}" for m, n, t in arrows()
             if _room(m) is not None and _room(t) is not None and _room(t) > _room(m)]  # type: ignore[operator]
    assert wrong == []


def test_the_uploaded_scripts_import_only_the_standard_library() -> None:
    """Fault: a node runs fleet/remote/stage.py and the sim's zip (fleet/sim/, `fleet.sim.bundle`) with
    a bare python3 — a third-party (or other fleet) import would fail there and only there."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    scripts = [ROOT / "fleet" / "remote" / "stage.py", *sorted((ROOT / "fleet" / "sim").glob("*.py"))]
    bad = []
    for path in scripts:
        for node in _every_import(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if getattr(node, "level", 0) == 0 and name.split(".")[0] not in stdlib and not name.startswith("fleet.sim"):
                    bad.append(f"{path.relative_to(ROOT)} (line {node.lineno}) imports {name}")
    assert bad == []


def test_the_arrow_checks_see_what_they_must(tmp_path: Path) -> None:
    """The checkers themselves: a deferred or TYPE_CHECKING import counts as an arrow; a room's rank."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    import flows\nif TYPE_CHECKING:\n    import tasks\n")
    assert sorted(n.names[0].name for n in _every_import(src)) == ["flows", "tasks"]
    assert _room("fleet.generation.data.store") == 0 and _room("fleet.generation.multinode.chunks") == 3
    assert _room("fleet.generation") is None and _room("fleet.servers") is None


def test_each_room_is_drawn_the_same_in_readme_its_docstring_and_its_files() -> None:
    """Fault: a map that differs from the house — README's layout, a room's docstring and the modules on
    disk drifting apart as modules are added, so a newcomer looks in the wrong room."""
    import re

    readme = (ROOT / "README.md").read_text()
    for room in GEN_ROOMS:
        pkg = ROOT / "fleet" / "generation" / room
        files = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
        in_doc = set(re.findall(r"(?<![/\w])(\w+)\.py\b", doc))   # a module it names, not a path
        line = re.search(rf"^ +{room}/ +(.*(?:\n {{30,}}\S.*)*)", readme, re.M)   # continuation: deeper than the names
        assert line, f"README's layout has no line for generation/{room}/"
        in_readme = set(re.findall(r"[a-z_]+", re.sub(r"\([^)]*\)", "", line.group(1))))   # (notes) aside
        assert files == in_doc, (room, files ^ in_doc)
        assert files == in_readme, (room, files ^ in_readme)
