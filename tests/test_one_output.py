"""One output per example is a regression prediction, never a one-class softmax.

On ``[E, B, 1]`` member predictions a softmax over one "class" is 1 for every
member, so every classification score would be a constant (variance, mutual
information and disagreement 0) while the members disagree: each raises,
naming the regression functions, which measure the disagreement (checked
against numpy's variance).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from ensembles import uncertainty

_PER_EXAMPLE = [
    "predictive_probs",
    "total_entropy",
    "expected_entropy",
    "mutual_information",
    "disagreement",
    "variance",
]
_LABELLED = [
    "nll",
    "accuracy",
    "brier",
    "ece",
    "adaptive_ece",
    "mce",
    "aurc",
    "augrc",
    "fit_temperature",
]

ONE_OUTPUT = jnp.asarray(
    np.random.default_rng(0).normal(0.0, 0.64, (4, 6, 1)), jnp.float32
)


@pytest.mark.parametrize("name", _PER_EXAMPLE + _LABELLED + ["scale_temperature"])
def test_classification_functions_refuse_one_output(name):
    function = getattr(uncertainty, name)
    args = (ONE_OUTPUT,)
    if name in _LABELLED:
        args += (jnp.zeros(6, jnp.int32),)
    elif name == "scale_temperature":
        args += (1.0,)
    with pytest.raises(
        ValueError,
        match=r"one class.*epistemic_variance\(logits\[\.\.\., 0\]\).*regression",
    ):
        function(*args)


def test_the_regression_functions_measure_the_disagreement_instead():
    means = ONE_OUTPUT[..., 0]
    expected = np.var(np.asarray(means, np.float64), axis=0)
    assert expected.mean() > 0.1  # the members disagree
    np.testing.assert_allclose(
        uncertainty.epistemic_variance(means), expected, rtol=1e-5
    )
    np.testing.assert_allclose(uncertainty.mixture_variance(means), expected, rtol=1e-5)


def test_two_class_logits_still_work():
    two = jnp.concatenate([jnp.zeros_like(ONE_OUTPUT), ONE_OUTPUT], axis=-1)
    assert uncertainty.mutual_information(two).shape == (6,)


def test_float_labels_get_the_hint_that_fits_them():
    logits = jnp.zeros((2, 3, 4))
    with pytest.raises(TypeError, match=r"whole numbers.*labels\.astype\(jnp\.int32\)"):
        uncertainty.nll(logits, np.array([0.0, 1.0, 3.0]))
    with pytest.raises(TypeError, match="regression problem") as raised:
        uncertainty.nll(logits, np.array([0.2, 1.7, 3.1]))
    assert "astype" not in str(raised.value)
