"""The quick tier's thinned sweeps (tests/conftest.py) name real tests."""

import ast
import pathlib

from tests.conftest import THINNED_SWEEPS

TESTS = pathlib.Path(__file__).resolve().parent


def test_every_thinned_sweep_is_a_parametrized_test():
    for path, sweeps in THINNED_SWEEPS.items():
        tree = ast.parse((TESTS / path).read_text())
        parametrized = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            and any("parametrize" in ast.unparse(d) for d in node.decorator_list)
        }
        for name, stride in sweeps.items():
            assert name in parametrized, (path, name)
            assert isinstance(stride, int) and stride >= 2, (path, name, stride)
