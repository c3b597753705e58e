"""The architecture stays easy to see: each package imports only the packages the layer
contract allows, privacy is kept at package level, and no module grows past what one
reader holds in mind.

``CONTRACT`` below is the layer contract: which package may import which.  The tests read
the source (``ast``), so they see every import, those inside functions and under
``TYPE_CHECKING`` included; ``docs/architecture.md`` prints the same table, and a test keeps
the two in step."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800

# package -> (what lives there, the packages it may import besides itself)
# "leaf": the modules directly in shmq/ (errors, options, names, ...); "shmq": shmq/__init__.py,
# the public facade (connect, the errors, the interface's names, loaded lazily).
CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    "leaf": ("errors, options, names and small helpers (shmq/*.py)", frozenset()),
    "api": ("Broker, Queue, Message: the public interface; publisher, reply, limits", frozenset({"leaf"})),
    "journal": ("a durable queue's journal files: writing, reading back, recovery", frozenset({"leaf"})),
    "protocol": ("frames and their codec, the client connection, every command once",
                 frozenset({"api", "leaf"})),
    "client": ("the TCP clients: blocking (tcp) and asyncio (aio)",
               frozenset({"protocol", "api", "leaf"})),
    "core": ("shared memory: layout, locks, segments, registry, ring, groups, queue handles, "
             "the co-located transport, the server's interface",
             frozenset({"api", "journal", "protocol", "leaf"})),
    "spark": ("the PySpark data source and sink", frozenset({"api", "shmq", "leaf"})),
    "mp": ("the drop-in for multiprocessing's queues (shmq.mp)", frozenset({"api", "core", "leaf"})),
    "kombu": ("the kombu transport, for Celery (shmq.kombu)", frozenset({"api", "shmq", "leaf"})),
    "dramatiq": ("the Dramatiq broker (shmq.dramatiq)", frozenset({"api", "shmq", "leaf"})),
    "testing": ("the SIGKILL storm used by the tests and the benchmarks",
                frozenset({"api", "core", "shmq", "leaf"})),
    "server": ("shmq serve: supervisor, workers, journal writer, metrics (installed as shmq.server)",
               frozenset({"core", "journal", "protocol", "api", "leaf"})),
    "cli": ("the shmq command line (it may import anything)",
            frozenset({"server", "testing", "client", "core", "journal", "protocol", "api", "shmq", "mp",
                       "kombu", "dramatiq", "leaf"})),
    "shmq": ("shmq/__init__.py: connect() and the public names",
             frozenset({"api", "core", "client", "mp", "leaf"})),
}
# where an edge is allowed only to some modules of the package imported
NARROW = {
    ("server", "core"): {"shmq.core.serverqueue", "shmq.core.durability", "shmq.core.doorbell",
                         "shmq.core.readings"},  # the server's interface to queues
    ("core", "protocol"): {"shmq.protocol.bodies", "shmq.protocol.schemas"},  # record fields, as on the wire
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "shmq").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "server").glob("*.py")):
        out["shmq.server" if path.stem == "__init__" else f"shmq.server.{path.stem}"] = path
    return out


MODULES = _modules()


def package(name: str) -> str:
    parts = name.split(".")
    if name == "shmq":
        return "shmq"
    if len(parts) == 2 and (ROOT / "shmq" / f"{parts[1]}.py").is_file():
        return "leaf"
    return parts[1]


TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str, path: Path) -> set[str]:
    """The modules of ours that ``name`` imports.  ``from P import x`` imports the module
    ``P.x`` when there is one, else ``P`` itself; the parents Python runs on the way to a
    module are not counted."""
    pkg = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(TREES[name]):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
                       if a.name != "_speedups"]  # the compiled accelerator: a leaf, loaded by shmq.accel
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_contract_names_every_package_and_only_those() -> None:
    assert {package(m) for m in MODULES} == set(CONTRACT)
    for p, (_, allowed) in CONTRACT.items():
        assert allowed <= set(CONTRACT) - {p}, p


def test_every_import_is_allowed_by_the_layer_contract() -> None:
    bad = []
    for m, targets in GRAPH.items():
        for t in targets:
            a, b = package(m), package(t)
            if a == b:
                continue
            if b not in CONTRACT[a][1] or t not in NARROW.get((a, b), {t}):
                bad.append(f"{m} ({a}) imports {t} ({b})")
    assert bad == [], "\n".join(sorted(bad))


def test_the_import_graph_has_no_circle() -> None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_the_tcp_clients_reach_nothing_of_the_shared_memory_core() -> None:
    def reach(m: str, seen: set[str]) -> set[str]:
        for n in GRAPH[m]:
            if n not in seen:
                seen.add(n)
                reach(n, seen)
        return seen

    for client in ("shmq.client.tcp", "shmq.client.aio", "shmq.protocol.commands"):
        assert {package(m) for m in reach(client, set())} <= {"client", "protocol", "api", "leaf"}, client


def test_the_layer_contract_in_the_architecture_document_is_this_one() -> None:
    """docs/architecture.md prints CONTRACT as a table: one row per package, in this order."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `([a-z]+)` \| (.*?) \| (.*?) \|$", doc, re.M)
    want = [(p, what, ", ".join(f"`{a}`" for a in sorted(allowed)) or "nothing of ours")
            for p, (what, allowed) in CONTRACT.items()]
    assert rows == want


# -------------------------------------------------------------------------- privacy
def _inside_protocols(tree: ast.Module) -> set[int]:
    """The nodes in the bodies of the module's ``Protocol`` classes (by ``id``)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).startswith(("Protocol", "typing.Protocol"))
                                                  for b in node.bases):
            inside |= {id(n) for item in node.body for n in ast.walk(item)}
    return inside


def _defined(tree: ast.Module) -> set[str]:
    """The names a module gives a value or a body: functions, classes, globals, attributes it
    assigns, ``__slots__`` entries; a ``Protocol``'s declarations do not count (they name what
    another module's object must have)."""
    skip = _inside_protocols(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            names |= {c.value for c in ast.walk(node.value)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches(tree: ast.Module, own: set[str]) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            yield f"{node.lineno}: .{node.attr}"
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("shmq")):
            yield from (f"{node.lineno}: imports {a.name}" for a in node.names
                        if _private(a.name) and a.name != "_speedups")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in own):
            yield f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})"


OWN: dict[str, set[str]] = {}
for _m, _t in TREES.items():
    OWN.setdefault(package(_m) if package(_m) != "leaf" else _m, set()).update(_defined(_t))


@pytest.mark.parametrize("name", sorted(m for m in MODULES if package(m) != "core"), ids=str)
def test_outside_the_core_no_module_reaches_a_private_name_of_another_package(name: str) -> None:
    """Privacy at package level: a module touches ``x._name`` only when its own package
    defines ``_name`` (the core's modules share theirs; each leaf module is a package of its
    own).  Imports of ``_name``, and getattr/hasattr/setattr with one, count too."""
    own = OWN[package(name) if package(name) != "leaf" else name]
    assert list(_reaches(TREES[name], own)) == []


@pytest.mark.parametrize("name", sorted(MODULES), ids=str)
def test_no_module_outgrows_one_reading(name: str) -> None:
    n = len(MODULES[name].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"


def test_mypy_sees_the_server_as_shmq_server_through_its_link() -> None:
    """server/ installs as shmq.server; the link shmq/server -> ../server lets mypy check it
    under that name (``make lint``: ``mypy shmq tests bench``), so its imports are typed."""
    link = ROOT / "shmq" / "server"
    assert link.is_symlink() and link.resolve() == (ROOT / "server").resolve()
