"""Structure rules read from the source (every import counts: those under
``TYPE_CHECKING`` and inside functions too, as in an import graph). The layer contracts
between packages are ``.importlinter``'s (``make lint``); these are the module-level rules:

- no import cycle anywhere in ``pdserve``, between modules;
- the NIXL backend by side: ``nixl.prefill`` and ``nixl.decode`` never import each other,
  and ``nixl.agent`` (what both share) imports neither;
- transfer settings come from the environment in one place: only ``transfer_config`` (and
  the doctor's ``nixl.probe``) import ``pdserve.envs``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent
PKG = "pdserve"
DISAGG = "pdserve.disagg"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PKG, *parts])


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every pdserve module ``path`` imports: ``from a import b`` counts ``a.b`` when that is
    a module, else ``a`` (so ``from pdserve import envs`` is ``pdserve.envs``, not the
    package's ``__init__``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pdserve"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    names = set(paths)
    return {name: _imports(path, names) & names for name, path in paths.items()}


def test_no_import_cycle_in_pdserve():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_nixl_sides_do_not_import_each_other_and_agent_imports_neither():
    nixl = f"{DISAGG}.nixl"
    bad = []
    for m, deps in _graph().items():
        for side, others in (
            ("agent", ("prefill", "decode")),
            ("prefill", ("decode",)),
            ("decode", ("prefill",)),
        ):
            if m == f"{nixl}.{side}" or m.startswith(f"{nixl}.{side}."):
                bad += [(m, d) for d in deps for o in others if d.startswith(f"{nixl}.{o}")]
    assert bad == []


def test_only_transfer_config_and_the_doctor_read_the_environment():
    readers = sorted(
        name
        for name, deps in _graph().items()
        if name.startswith(f"{DISAGG}.") and "pdserve.envs" in deps
    )
    assert readers == [f"{DISAGG}.nixl.probe", f"{DISAGG}.transfer_config"]
