"""The package order of ``deinfer_megatron/__init__.py`` holds: no module imports a package
above its own (module-level and function-local imports alike), and siblings of one tier do
not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import deinfer_megatron

ROOT = Path(deinfer_megatron.__file__).parent


def _tier(package: str) -> int:
    for index, tier in enumerate(deinfer_megatron.PACKAGE_ORDER):
        if package in tier:
            return index
    raise AssertionError(f"package {package!r} is not placed in deinfer_megatron.PACKAGE_ORDER")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported deinfer_megatron module) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = ["deinfer_megatron", *path.relative_to(ROOT).with_suffix("").parts]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out += [(node.lineno, f"{module}.{a.name}" if module == "deinfer_megatron" else module)
                    for a in node.names]
    return [(line, m) for line, m in out if m.split(".")[0] == "deinfer_megatron"]


def test_every_package_is_placed() -> None:
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    placed = {name for tier in deinfer_megatron.PACKAGE_ORDER for name in tier}
    assert packages == placed, (sorted(packages - placed), sorted(placed - packages))


def test_imports_only_go_down() -> None:
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2:
            continue  # the top-level __init__ only states the order
        own = rel[0]
        for line, module in _imports(path):
            parts = module.split(".")
            if len(parts) < 2 or parts[1] == own:
                continue
            if _tier(parts[1]) >= _tier(own):
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not upward, "imports against the package order:\n" + "\n".join(upward)


def test_the_checker_sees_local_and_relative_imports(tmp_path) -> None:
    probe = ROOT / "files" / "_probe_for_test.py"
    probe.write_text("def f():\n    from deinfer_megatron.cli import main\n    from ..generation import job\n")
    try:
        found = [m for _, m in _imports(probe)]
    finally:
        probe.unlink()
    assert found == ["deinfer_megatron.cli", "deinfer_megatron.generation"]


def _import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the project's modules it imports (module-level and function-local alike): a
    ``from package import module`` names the module, ``from module import name`` the module."""
    modules = {".".join(["deinfer_megatron", *p.relative_to(root).with_suffix("").parts]).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") + (["__init__"] if path.name == "__init__.py" else [])
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name and not name.startswith(target + "."):
                    out.add(target)
        graph[name] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    """No two modules import each other, directly or around a circle: each can be read and
    loaded after what it imports (a circle is what function-local imports used to hide)."""
    assert not _cycles(_import_graph()), _cycles(_import_graph())


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_projects_imports_are_at_module_level() -> None:
    """Every import of the project's own modules is at the top of its module, where a reader sees
    what the module depends on: none is hidden in a function (nothing forces one there, since
    there are no circles). External heavy imports (transformers, deepspeed) may stay lazy."""
    hidden = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        top = {id(node) for node in tree.body}
        for node in tree.body:  # an ``if TYPE_CHECKING:`` block is top level too
            if isinstance(node, ast.If):
                top |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if getattr(node, "level", 0) or any(n.split(".")[0] == "deinfer_megatron" for n in names):
                    hidden.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not hidden, "imports of the project's modules inside functions:\n" + "\n".join(hidden)
