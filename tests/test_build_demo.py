"""The demo's build script: its corpus and the portable configs it installs."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build_demo", ROOT / "scripts" / "build_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOURCE = '''
import os


def public(a, b=2):
    """Add two numbers.

    More text that is not part of the request.
    """
    return a + b


class Thing:
    def method(self):
        """Return the thing's name."""
        return self.name

    def _private(self):
        """Hidden."""


def undocumented():
    return 1
'''


def test_chat_pairs_ask_for_documented_public_functions(build):
    pairs = build.chat_pairs(SOURCE)
    requests = [p["messages"][0]["content"] for p in pairs]
    answers = [p["messages"][1]["content"] for p in pairs]
    assert requests == ["Write a Python function `public`: Add two numbers.",
                        "Write a Python function `method`: Return the thing's name."]
    assert answers[0].startswith("def public(a, b=2):") and "return a + b" in answers[0]
    assert answers[1].startswith("def method(self):")  # dedented out of its class
    assert build.chat_pairs("def broken(:") == []


def test_portable_configs_hold_no_path_of_the_machine(build, tmp_path):
    work = tmp_path / "work"
    config = {"model_type": "qwen3", "mlx_spec": {"source": str(work / "target-lm")},
              "base_model_name_or_path": str(work / "target-lm"), "layers": [str(work / "x")]}
    target = build.portable_config(config, work, "target")
    assert target["_name_or_path"] == target["mlx_spec"]["source"] == "mlx-spec/demo"
    assert target["base_model_name_or_path"] == "mlx-spec/demo" and target["layers"] == ["mlx-spec/demo-x"]
    assert build.portable_config(config, work, "layerskip")["_name_or_path"] == "mlx-spec/demo-layerskip"
    drafter = build.portable_config({"base_model_name_or_path": str(work / "target-lm")}, work, "medusa")
    assert str(tmp_path) not in json.dumps(drafter)


def test_function_head_is_the_signature_and_docstring(build):
    source = 'def f(a,\n      b):\n    """Add.\n\n    Two numbers."""\n    c = a + b\n    return c\n'
    assert build.function_head(source) == 'def f(a,\n      b):\n    """Add.\n\n    Two numbers."""\n'
    assert build.parses(source) and not build.parses("    def f():\n        pass\n")
