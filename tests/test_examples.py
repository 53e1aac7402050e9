import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_runs_and_learns(capsys):
    pytest.importorskip("sklearn", reason="examples need the `examples` extra")
    accuracy = load("quickstart").main(["--steps", "60", "--members", "2"])
    out = capsys.readouterr().out
    assert "member 1: test accuracy" in out
    assert "view(model, member=0) reproduces member 0: True" in out
    assert "of nnx.Linear layers, reproduces member 0: True" in out
    # Ten classes: chance is 0.1; 60 Adam steps already get far above it.
    assert accuracy > 0.5
