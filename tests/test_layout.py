"""The package's layout rules: no module over 400 lines, no import cycle between kb_nano's
modules (imports at module level, which run when the module is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(tree: ast.Module, name: str, is_package: bool, mods: dict[str, Path]) -> set[str]:
    """The kb_nano modules a module's top-level statements import: ``import a.b`` and
    ``from a.b import f`` (``f`` defined in ``a.b``) depend on ``a.b``, ``from a.b import c``
    with ``c`` a submodule on ``a.b.c``. The parent packages Python initialises first are not
    edges (a package's ``__init__`` may import its own submodules, the usual facade); a
    submodule that takes a name from its package's ``__init__`` while that ``__init__``
    imports it is a cycle."""
    targets = set()
    for node in tree.body:  # module level only: imports inside functions run when called
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            submodules = {f"{base}.{alias.name}" for alias in node.names} & mods.keys()
            targets |= submodules
            if len(submodules) < len(node.names):  # a name defined by ``base`` itself
                targets.add(base)
    return {t for t in targets if t in mods and t != name}


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_kb_nano_has_no_import_cycle():
    mods = _modules()
    graph = {
        name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", mods)
        for name, path in mods.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v) :] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])
