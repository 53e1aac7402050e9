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
    assert "reproduces member 0: True" in out
    # Ten classes: chance is 0.1; 60 Adam steps already get far above it.
    assert accuracy > 0.5


def test_digits_uncertainty_smoke(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="examples need the `examples` extra")
    pytest.importorskip("tqdm", reason="examples need the `examples` extra")
    plot = tmp_path / "digits.png"
    args = ["--steps", "40", "--members", "2"]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if has_matplotlib:
        args += ["--plot", str(plot)]
    results = load("digits_uncertainty").main(args)
    out = capsys.readouterr().out
    assert set(results) == {"single", "batchensemble", "deep_ensemble"}
    for name, r in results.items():
        assert r["accuracy"] > 0.5, name  # 5 classes: chance is 0.2
        assert 0.0 <= r["auroc_entropy"] <= 1.0
    # The BatchEnsemble holds far fewer parameters than the deep ensemble.
    assert results["batchensemble"]["params"] < 0.6 * results["deep_ensemble"]["params"]
    assert "AUROC" in out
    if has_matplotlib:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
