"""The architecture stays easy to see: imports point one way, the server keeps to the
interfaces made for it, and no module grows past what one reader holds in mind.

These read the source (``ast``), so they see every import, those inside functions and
under ``TYPE_CHECKING`` included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"shmq": ROOT / "shmq", "shmq.server": ROOT / "server"}  # server/ installs as shmq.server
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            out[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of ours that ``name`` imports (a package's own ``__init__`` is not
    counted as imported by its submodules: Python runs it first anyway)."""
    pkg = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                up = parts[:len(parts) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            if t in MODULES and t != name and not (t in PACKAGES and name.startswith(t + ".")):
                found.add(t)
    return found


def test_the_import_graph_has_no_circle() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_the_client_transports_do_not_import_the_shared_memory_core() -> None:
    core = {"shmq.core.queue", "shmq.core.handle", "shmq.core.consumer", "shmq.core.ring", "shmq.core.groups",
            "shmq.core.lock", "shmq.core.colocated", "shmq.core.segment", "shmq.core.registry"}

    def reach(m: str, seen: set[str]) -> set[str]:
        for n in _imports(m, MODULES[m]):
            if n not in seen:
                seen.add(n)
                reach(n, seen)
        return seen

    for client in ("shmq.client.tcp", "shmq.client.aio"):
        assert reach(client, set()) & core == set(), client


@pytest.mark.parametrize("path", sorted((ROOT / "server").glob("*.py")), ids=lambda p: p.name)
def test_the_server_touches_no_private_attribute_of_a_shmq_object(path: Path) -> None:
    """``server/`` calls ``shmq.core.serverqueue`` and ``shmq.core.durability``: no ``x._name``
    of anything but its own objects, and no shared-memory layout."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and (node.module == "shmq.core.layout" or (
                node.module == "shmq" and any(a.name == "layout" for a in node.names))):
            bad.append(f"{path.name}:{node.lineno}: imports the layout")
    assert bad == []


@pytest.mark.parametrize("name", sorted(MODULES), ids=str)
def test_no_module_outgrows_one_reading(name: str) -> None:
    n = len(MODULES[name].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"
