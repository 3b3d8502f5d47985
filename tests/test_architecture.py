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
