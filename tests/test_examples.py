import importlib.util
import pathlib
import re

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quickstart_runs_and_learns(capsys):
    pytest.importorskip("sklearn", reason="examples need the `examples` extra")
    accuracy = load("quickstart").main(["--steps", "60", "--members", "2"])
    out = capsys.readouterr().out
    assert "member 1: test accuracy" in out
    assert "view(model, member=0) reproduces member 0: True" in out
    assert "of nnx.Linear layers, reproduces member 0: True" in out
    # Ten classes: chance is 0.1; 60 Adam steps already get far above it.
    assert accuracy > 0.5


def test_the_docs_state_the_quickstarts_defaults():
    # getting_started.md and the script's own usage line give its defaults.
    defaults = vars(load("quickstart").parse_args([]))
    page = (EXAMPLES.parent / "docs" / "getting_started.md").read_text()
    stated = re.search(r"`examples/quickstart.py ((?:--\w+ \d+ ?)+)` are its", page)
    assert stated, "getting_started.md must state the quickstart's defaults"
    usage = re.search(
        r"python examples/quickstart.py ((?:\[--\w+ \d+\] ?)+)",
        (EXAMPLES / "quickstart.py").read_text(),
    )
    for text in (stated.group(1), usage.group(1)):
        pairs = re.findall(r"--(\w+) (\d+)", text)
        assert {name: int(value) for name, value in pairs} == defaults, text
