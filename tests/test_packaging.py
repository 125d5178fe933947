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
