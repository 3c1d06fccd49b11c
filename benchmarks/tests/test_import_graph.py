"""The benchmark package's modules import each other without a circle (function-level imports included), and no
module imports the command line's ``__main__``."""

from __future__ import annotations

import ast
from pathlib import Path

import memfit_benchmarks

PACKAGE = Path(memfit_benchmarks.__file__).parent


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "memfit_benchmarks":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("memfit_benchmarks."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("memfit_benchmarks."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    return {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> list[str] | None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                return [*trail, name, dep]
            if dep not in state and (found := visit(dep, [*trail, name])):
                return found
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [])):
            return found[found.index(found[-1]) :]
    return None


def test_no_import_circle():
    assert _circle(_graph()) is None


def test_nothing_imports_the_command_line():
    assert not [name for name, deps in _graph().items() if "__main__" in deps]


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    (tmp_path / "a.py").write_text("from memfit_benchmarks.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from memfit_benchmarks import a\n")
    graph = {"a": _imports(tmp_path / "a.py"), "b": _imports(tmp_path / "b.py")}
    assert graph == {"a": {"b"}, "b": {"a"}} and _circle(graph) == ["a", "b", "a"]
