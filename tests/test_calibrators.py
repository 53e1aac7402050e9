"""Vector, Dirichlet and isotonic calibration against independent references.

Vector and Dirichlet scaling: the same regularised NLL written in float64
numpy and minimised by scipy's L-BFGS-B to its tightest tolerances.
Isotonic: scikit-learn's IsotonicRegression(out_of_bounds="clip") per class,
then the classes renormalised, as CalibratedClassifierCV does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import log_softmax, logsumexp

from ensembles import uncertainty
from ensembles.uncertainty.classification.calibrators import calibration_inputs


def miscalibrated(num_members=3, num_examples=400, num_classes=5, seed=0):
    """Overconfident members whose classes are biased differently."""
    rng = np.random.default_rng(seed)
    truth = rng.standard_normal((num_examples, num_classes))
    truth[:, 0] += 0.7  # class 0 is more common than the members think
    labels = np.array(
        [rng.choice(num_classes, p=np.exp(log_softmax(t))) for t in truth]
    )
    noise = rng.standard_normal((num_members, num_examples, num_classes))
    logits = 2.5 * (truth[None] + 0.5 * noise)
    logits[..., 0] -= 2.0
    return logits.astype(np.float32), labels


def ref_inputs(logits, members):
    log_probs = log_softmax(np.asarray(logits, np.float64), axis=-1)
    if members:
        return log_probs
    return (logsumexp(log_probs, axis=0) - np.log(len(log_probs)))[None]


def ref_fit(
    kind, z, labels, scale_penalty=0.0, off_diagonal_penalty=0.0, bias_penalty=0.0
):
    num_examples, num_classes = z.shape

    def unpack(theta):
        if kind == "vector":
            return theta[:num_classes], theta[num_classes:]
        return (
            theta[: num_classes**2].reshape(num_classes, num_classes),
            theta[num_classes**2 :],
        )

    def objective(theta):
        """The NLL plus penalties, and its gradient, written out."""
        first, biases = unpack(theta)
        mapped = z * first + biases if kind == "vector" else z @ first.T + biases
        rows = np.arange(num_examples)
        nll = np.mean(logsumexp(mapped, axis=-1) - mapped[rows, labels])
        slope = np.exp(log_softmax(mapped, axis=-1))
        slope[rows, labels] -= 1
        slope /= num_examples
        penalty = bias_penalty * np.mean(biases**2)
        bias_gradient = slope.sum(axis=0) + 2 * bias_penalty * biases / num_classes
        scales = first if kind == "vector" else np.diag(first)
        penalty += scale_penalty * np.mean((scales - 1) ** 2)
        scale_gradient = 2 * scale_penalty * (scales - 1) / num_classes
        if kind == "vector":
            first_gradient = (slope * z).sum(axis=0) + scale_gradient
        else:
            off = 1 - np.eye(num_classes)
            pairs = num_classes * (num_classes - 1)
            penalty += off_diagonal_penalty * (first**2 * off).sum() / pairs
            first_gradient = (
                slope.T @ z
                + 2 * off_diagonal_penalty * first * off / pairs
                + np.diag(scale_gradient)
            )
        gradient = np.concatenate([first_gradient.ravel(), bias_gradient])
        return nll + penalty, gradient

    start = np.ones(num_classes) if kind == "vector" else np.eye(num_classes).ravel()
    result = minimize(
        objective,
        np.concatenate([start, np.zeros(num_classes)]),
        jac=True,
        method="L-BFGS-B",
        options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 20000},
    )
    first, biases = unpack(result.x)
    mapped = z * first + biases if kind == "vector" else z @ first.T + biases
    return first, biases, result.fun, np.exp(log_softmax(mapped, axis=-1))


PARAMETRIC = {
    "vector": (
        uncertainty.fit_vector_scaling,
        uncertainty.apply_vector_scaling,
        {"scale_penalty": 0.03, "bias_penalty": 0.02},
    ),
    "dirichlet": (
        uncertainty.fit_dirichlet_scaling,
        uncertainty.apply_dirichlet_scaling,
        {"scale_penalty": 0.03, "off_diagonal_penalty": 0.5, "bias_penalty": 0.02},
    ),
}


@pytest.mark.parametrize("kind", sorted(PARAMETRIC))
@pytest.mark.parametrize("members", [False, True])
def test_parametric_calibrators_equal_scipys_minimum(kind, members):
    fit, apply, options = PARAMETRIC[kind]
    logits, labels = miscalibrated()
    first, biases = fit(logits, labels, members=members, **options)
    calibrated = np.exp(np.asarray(apply(logits, first, biases)))
    z = ref_inputs(logits, members)
    first, biases = np.asarray(first).reshape(len(z), -1), np.asarray(biases)
    for k in range(len(z)):
        ref_first, ref_biases, _, ref_probs = ref_fit(kind, z[k], labels, **options)
        np.testing.assert_allclose(first[k], ref_first.ravel(), atol=1e-4)
        np.testing.assert_allclose(biases.reshape(len(z), -1)[k], ref_biases, atol=1e-4)
        np.testing.assert_allclose(calibrated[k], ref_probs, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(PARAMETRIC))
def test_parametric_calibrators_under_jit_and_on_new_examples(kind):
    fit, apply, options = PARAMETRIC[kind]
    logits, labels = miscalibrated(num_examples=800, seed=1)
    held_out, test = (logits[:, :400], labels[:400]), (logits[:, 400:], labels[400:])
    eager = fit(*held_out, **options)
    jitted = jax.jit(lambda z, y: fit(z, y, **options))(*held_out)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    calibrated = apply(test[0], *eager)
    np.testing.assert_allclose(
        jax.jit(apply)(test[0], *eager), calibrated, rtol=1e-6, atol=1e-6
    )
    # Fitted on held-out examples, it calibrates new ones better than nothing;
    # vector scaling, which can undo a class's bias, better than a temperature.
    assert float(uncertainty.nll(calibrated, test[1])) < float(
        uncertainty.nll(test[0], test[1])
    )
    if kind == "vector":
        temperature = uncertainty.fit_temperature(*held_out)
        scaled = uncertainty.scale_temperature(test[0], temperature)
        assert float(uncertainty.nll(calibrated, test[1])) < float(
            uncertainty.nll(scaled, test[1])
        )


def test_ruled_out_classes_stay_ruled_out_and_identity_maps_change_nothing():
    logits = np.array([[[0.0, -np.inf, 0.0], [0.2, 0.3, 0.5]]], np.float32)
    for apply, first in (
        (uncertainty.apply_vector_scaling, jnp.ones(3)),
        (uncertainty.apply_dirichlet_scaling, jnp.eye(3)),
    ):
        out = np.exp(np.asarray(apply(logits, first, jnp.zeros(3))))
        np.testing.assert_allclose(out[0], jax.nn.softmax(logits[0]), atol=1e-6)
        assert out[0, 0, 1] == 0.0
    labels = np.array([1, 1])  # example 0's label is ruled out: no fit exists
    assert np.isnan(np.asarray(uncertainty.fit_vector_scaling(logits, labels)[0])).all()


def test_a_fit_never_ends_worse_than_where_it_started():
    logits, labels = miscalibrated(seed=2)
    logits = logits / 10  # nearly calibrated: little to gain
    for fit, apply, options in PARAMETRIC.values():
        calibrated = apply(logits, *fit(logits, labels, **options))
        assert (
            float(uncertainty.nll(calibrated, labels))
            <= float(uncertainty.nll(logits, labels)) + 1e-6
        )


# ------------------------------------------------------------------ isotonic


def ref_isotonic(probs_fit, labels, probs_new):
    from sklearn.isotonic import IsotonicRegression

    num_classes = probs_fit.shape[-1]
    out = np.zeros_like(probs_new)
    for c in range(num_classes):
        regression = IsotonicRegression(out_of_bounds="clip")
        regression.fit(probs_fit[:, c], (labels == c).astype(np.float64))
        out[:, c] = regression.predict(probs_new[:, c])
    total = out.sum(axis=-1, keepdims=True)
    return np.divide(
        out, total, out=np.full_like(out, 1 / num_classes), where=total != 0
    )


@pytest.mark.parametrize("members", [False, True])
def test_isotonic_equals_scikit_learns(members):
    logits, labels = miscalibrated(num_examples=600, seed=3)
    # Repeated examples: ties in every class's probabilities.
    logits = np.concatenate([logits[:, :200], logits[:, :100], logits[:, 200:]], 1)
    labels = np.concatenate([labels[:200], (labels[:100] + 1) % 5, labels[200:]])
    fit_part = slice(0, 400)
    knots, values = uncertainty.fit_isotonic(
        logits[:, fit_part], labels[fit_part], members=members
    )
    applied = uncertainty.apply_isotonic(logits, knots, values)
    calibrated = np.exp(np.asarray(applied))
    # The reference gets the probabilities the calibrator maps, bit for bit:
    # an isotonic fit may jump between two knots 1e-7 apart, where any
    # rounding of the inputs would move the output.
    inputs = jax.jit(calibration_inputs, static_argnums=1)(logits, members)
    groups = np.exp(np.asarray(inputs, np.float64))
    for k, group in enumerate(groups):
        expected = ref_isotonic(group[fit_part], labels[fit_part], group)
        np.testing.assert_allclose(calibrated[k], expected, atol=2e-6)
    assert bool(jnp.all(jnp.diff(values, axis=-1) >= 0))
    assert bool(jnp.all(jnp.diff(knots, axis=-1) >= 0))
    jitted = jax.jit(uncertainty.fit_isotonic, static_argnames="members")(
        logits[:, fit_part], labels[fit_part], members=members
    )
    np.testing.assert_array_equal(jitted[1], values)
    np.testing.assert_allclose(
        jax.jit(uncertainty.apply_isotonic)(logits, knots, values), applied, rtol=1e-6
    )


def test_isotonic_lowers_the_ece_it_was_fitted_on():
    logits, labels = miscalibrated(seed=4)
    calibrated = uncertainty.apply_isotonic(
        logits, *uncertainty.fit_isotonic(logits, labels)
    )
    assert float(uncertainty.ece(calibrated, labels)) < 0.5 * float(
        uncertainty.ece(logits, labels)
    )


# ------------------------------------------------------------------- contract

FITS = {
    "vector": (uncertainty.fit_vector_scaling, uncertainty.apply_vector_scaling),
    "dirichlet": (
        uncertainty.fit_dirichlet_scaling,
        uncertainty.apply_dirichlet_scaling,
    ),
    "isotonic": (uncertainty.fit_isotonic, uncertainty.apply_isotonic),
}


@pytest.mark.parametrize("kind", sorted(FITS))
def test_nan_in_nan_out(kind):
    fit, apply = FITS[kind]
    logits, labels = miscalibrated(seed=5)
    broken = logits.copy()
    broken[2, 7, 1] = np.nan
    for members in (False, True):
        fitted = fit(broken, labels, members=members)
        assert all(np.isnan(np.asarray(a)).all() for a in fitted), members
    fitted = fit(logits, labels)
    out = np.asarray(apply(broken, *fitted))
    assert np.isnan(out[:, 7]).all()
    assert not np.isnan(np.delete(out, 7, axis=1)).any()
    # Under jit: NaN parameters make everything NaN; a bad label, a NaN fit.
    poisoned = [jnp.full_like(a, jnp.nan) for a in fitted]
    assert np.isnan(np.asarray(jax.jit(apply)(logits, *poisoned))).all()
    bad = labels.copy()
    bad[0] = 9
    assert all(np.isnan(np.asarray(a)).all() for a in jax.jit(fit)(logits, bad))


@pytest.mark.parametrize("kind", sorted(FITS))
def test_bad_inputs_raise_clearly_and_mutate_nothing(kind):
    fit, apply = FITS[kind]
    logits, labels = miscalibrated(seed=6)
    before = logits.copy()
    with pytest.raises(ValueError, match=r"`logits` must have shape \[E, B, C\]"):
        fit(logits[0], labels)
    with pytest.raises(ValueError, match=r"`labels` must lie in \[0, C\)"):
        fit(logits, labels + 5)
    with pytest.raises(TypeError, match="`members` must be a bool"):
        fit(logits, labels, members="yes")
    fitted = fit(logits, labels)
    member_fitted = fit(logits, labels, members=True)
    with pytest.raises(ValueError, match="members=True"):
        apply(logits[:, :, :4], *fitted)
    with pytest.raises(ValueError, match="all be pooled or all per member"):
        apply(logits, fitted[0], member_fitted[1])
    with pytest.raises(ValueError, match="finite"):
        apply(logits, jnp.full_like(fitted[0], jnp.nan), fitted[1])
    with pytest.raises(TypeError, match="must be"):
        apply(logits, None, fitted[1])
    np.testing.assert_array_equal(logits, before)


def test_bad_options_raise_clearly():
    logits, labels = miscalibrated(seed=7)
    with pytest.raises(ValueError, match="`bias_penalty` must be a finite number"):
        uncertainty.fit_vector_scaling(logits, labels, bias_penalty=-1.0)
    with pytest.raises(ValueError, match="`scale_penalty` must be a finite number"):
        uncertainty.fit_dirichlet_scaling(logits, labels, scale_penalty=np.nan)
    with pytest.raises(ValueError, match="`off_diagonal_penalty`"):
        uncertainty.fit_dirichlet_scaling(logits, labels, off_diagonal_penalty=np.inf)
    with pytest.raises(ValueError, match="`iterations` must be an int >= 1"):
        uncertainty.fit_dirichlet_scaling(logits, labels, iterations=0)
    knots, values = uncertainty.fit_isotonic(logits, labels)
    with pytest.raises(ValueError, match="`knots` must ascend"):
        uncertainty.apply_isotonic(logits, knots[:, ::-1], values)
    with pytest.raises(ValueError, match=r"`values` must be non-decreasing.*\[0, 1\]"):
        uncertainty.apply_isotonic(logits, knots, values * 2)
    with pytest.raises(ValueError, match="N >= 1"):
        uncertainty.apply_isotonic(logits, knots[:, :0], values[:, :0])
