"""The distribution installs one import name, mlx_spec, with every subpackage."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_every_package_is_listed():
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    dirs = setup["package-dir"]
    found = {"mlx_spec." + ".".join(p.parent.relative_to(ROOT / "mlx_spec").parts) for p in (ROOT / "mlx_spec").rglob("__init__.py")}
    found = {name.rstrip(".") for name in found}
    for name, folder in dirs.items():
        found |= {name + "".join("." + part for part in p.parent.relative_to(ROOT / folder).parts)
                  for p in (ROOT / folder).rglob("__init__.py")}
    assert found == listed
    assert all(name == "mlx_spec" or name.startswith("mlx_spec.") for name in listed)


def test_subpackages_import():
    import mlx_spec.convert
    import mlx_spec.tui

    assert Path(mlx_spec.tui.__file__).parent.name == "tui"
    assert Path(mlx_spec.convert.__file__).parent.name == "convert"


def imports_of(path: Path) -> set[str]:
    """The modules a source file imports (anywhere in it, functions included)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_convert_is_the_top_layer():
    """Only the command line and the Python API (the layer above convert/) import
    mlx_spec.convert; the checkpoint readers sit below models/ and drafters/."""
    above = {ROOT / "mlx_spec" / "cli.py", ROOT / "mlx_spec" / "api.py"}
    for path in (ROOT / "mlx_spec").rglob("*.py"):
        if path not in above:
            assert not any(m == "mlx_spec.convert" or m.startswith("mlx_spec.convert.") for m in imports_of(path)), path
    for path in (ROOT / "tui").rglob("*.py"):
        assert not any(m.startswith("mlx_spec.convert") for m in imports_of(path)), path
    assert not any(m.startswith(("mlx_spec.models", "mlx_spec.drafters")) for m in imports_of(ROOT / "mlx_spec" / "weights.py"))


def package_modules() -> dict[str, Path]:
    """Every module of the installed package by its import name, whichever folder holds it."""
    import tomllib

    dirs = {"mlx_spec": ROOT / "mlx_spec", **{name: ROOT / folder for name, folder in
                                              tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}}
    modules = {}
    for prefix, folder in dirs.items():
        for path in folder.rglob("*.py"):
            parts = (prefix, *path.relative_to(folder).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in it, functions included)."""
    import ast

    modules = package_modules()

    def module_of(imported: str) -> str:
        while imported and imported not in modules:  # `from pkg.mod import name`: pkg.mod
            imported = imported.rpartition(".")[0]
        return imported

    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {module_of(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:  # `from pkg import mod` imports pkg.mod
                found |= {module_of(f"{node.module}.{a.name}") for a in node.names}
        graph[name] = found - {"", name}
    return graph


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "mlx_spec.models.mlxlm" in graph["mlx_spec.models.load"]  # (the graph sees imports inside functions)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    cycles = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if reaches(b, a))
    assert not cycles, cycles


# Argument parsers list every flag of a command: long by nature, and read as tables.
PARSERS = {"build_parser", "add_parser"}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_modules_and_functions_stay_short():
    import ast

    for name, path in package_modules().items():
        text = path.read_text()
        assert len(text.splitlines()) <= 500, f"{name}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in PARSERS:
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{name}.{node.name}: {length} lines"
