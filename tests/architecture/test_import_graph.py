"""The package's import graph follows the house in docs/architecture.md: no import cycle between modules,
and no import from a lower floor into a higher one except the arrows named in ``BACK_ARROWS``.

Every import counts, at module level or inside a function (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"

# Rooms from the top floor down: a request's data walks this way; a room imports only rooms below it.
FLOORS: list[tuple[str, ...]] = [
    ("bench",),
    ("entrypoints",),
    ("server",),
    ("scaleout",),
    ("frontend",),
    ("core",),
    ("executor",),
    ("worker",),
    ("spec_decode",),
    ("models", "lora"),
    ("distributed", "attention"),
    ("ops", "kv"),
    ("protocol", "config"),
    ("structured", "cpu_env"),
]
# (from room, to room): why this arrow runs up. docs/architecture.md names the same ones.
BACK_ARROWS: dict[tuple[str, str], str] = {
    ("entrypoints", "bench"): "the `pagedllm bench` subcommand; the benches drive the engine through LLM, as users do",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (``from pagedllm import ops`` names the module ``pagedllm.ops``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pagedllm")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("pagedllm"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in mods else node.module)
    return {m for m in found if m in mods}


def room(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def floor_of() -> dict[str, int]:
    return {r: len(FLOORS) - i for i, rooms in enumerate(FLOORS) for r in rooms}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(p, mods) - {m} for m, p in mods.items()}


def test_every_room_has_a_floor():
    rooms = {room(m) for m in modules()} - {"<root>"}
    assert rooms <= set(floor_of()), f"rooms without a floor in FLOORS: {sorted(rooms - set(floor_of()))}"


def test_no_import_cycles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_runs_up_a_floor():
    floors = floor_of()
    up = []
    for mod, deps in graph().items():
        src = room(mod)
        for dep in deps:
            dst = room(dep)
            if "<root>" in (src, dst) or src == dst:
                if dst == "<root>" and src != "<root>":
                    up.append(f"{mod} -> {dep} (the package root is the front door, not a library)")
                continue
            if floors[dst] > floors[src] and (src, dst) not in BACK_ARROWS:
                up.append(f"{mod} -> {dep} ({src} is below {dst})")
    assert not up, "imports that run back up:\n" + "\n".join(sorted(up))


def test_back_arrows_are_used_and_few():
    """A named back-arrow that no import needs any more is removed from the list; at most 4 are allowed."""
    used = {(room(m), room(d)) for m, deps in graph().items() for d in deps}
    assert set(BACK_ARROWS) <= used, f"stale BACK_ARROWS: {set(BACK_ARROWS) - used}"
    assert len(BACK_ARROWS) <= 4


@pytest.mark.parametrize("bad", [("a", "b", "a")])
def test_the_cycle_check_can_fail(bad, monkeypatch):
    """The checker sees a cycle when there is one (a graph with a -> b -> a)."""
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: {"pagedllm.x.a": {"pagedllm.x.b"}, "pagedllm.x.b": {"pagedllm.x.a"}})
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles()
