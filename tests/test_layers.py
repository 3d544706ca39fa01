"""The packages point one way: qpack <- actors <- pipeline, with no import cycles.

Walks the source of every module (imports at any depth, lazy and type-only ones included)
rather than importing it, so an upward import hidden inside a function is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK = {"qpack": 0, "actors": 1, "pipeline": 2}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in RANK for p in (ROOT / top).rglob("*.py")}


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (they never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(name: str, path: Path, known: set[str], typing: bool = True) -> set[str]:
    """Project modules that `name` imports (a `from pkg import mod` counts as pkg.mod).

    `typing=False` leaves out imports under `if TYPE_CHECKING:`.
    """
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if typing else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in RANK)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.split(".")[0] not in RANK:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return out


def _graph(typing: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known, typing) & known for name, path in modules.items()}


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{src} imports {dst}"
        for src, dsts in _graph().items()
        for dst in dsts
        if RANK[dst.split(".")[0]] > RANK[src.split(".")[0]]
    ]
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # A package importing its own submodules (its __init__) is not a cycle.
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    # Every import that runs counts, lazy ones included.
    assert _cycles(_graph(typing=False)) == []


def test_no_import_cycles_type_only_ones_included() -> None:
    # A type-only import never runs, but a loop through one is still two modules that
    # must be read together (and a type checker follows it): none either.
    assert _cycles(_graph(typing=True)) == []


def test_the_walker_sees_a_cycle_and_an_upward_import() -> None:
    # The checks above can fail: a made-up graph with both faults is flagged.
    assert _cycles({"actors.a": {"actors.b"}, "actors.b": {"actors.a"}})
    assert RANK["pipeline"] > RANK["actors"]


def test_the_faces_use_the_engines_surface_not_its_core() -> None:
    # The server, the CLI and the benchmarks hold an `Engine` and use its documented
    # surface; only the engine's own modules (generation, the distributed stage) take the
    # `EngineCore` with the actors in it.
    faces = [p for d in ("pipeline/server", "pipeline/cli", "pipeline/bench")
             for p in (ROOT / d).rglob("*.py")]
    reaching = [str(p.relative_to(ROOT)) for p in faces
                if "._core" in (text := p.read_text()) or "engine_core" in text
                or "engine_open" in text]
    assert faces and reaching == []
