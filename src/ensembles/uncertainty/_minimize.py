"""A jit-able L-BFGS for the calibrators' small, smooth, convex fits.

The calibrators of :mod:`ensembles.uncertainty.classification.calibrators` minimise a
regularised NLL of a few to a few thousand parameters. The runtime depends on
JAX alone (no optax, no jax.scipy.optimize, whose BFGS keeps an ``n x n``
inverse Hessian), so this is the textbook method (Nocedal & Wright, 2006,
Algorithms 7.4 and 7.5): a memory of the last :data:`MEMORY` steps, the
two-loop recursion for the direction, and a backtracking line search on the
Armijo condition, where near the minimum a step that the objective cannot
tell from rounding is taken if the gradient shrinks. It stops after
``iterations`` steps, or as soon as no step is taken (converged to the
dtype's precision). Under
:func:`jax.vmap` (one fit per member) every fit runs until the last stops.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

#: How many past steps shape the direction.
MEMORY = 10

#: Halvings of the step before a line search gives up (2**-40 of a step).
_BACKTRACKS = 40

#: The Armijo constant: a step must achieve this share of the linear decrease.
_ARMIJO = 1e-4


def _direction(gradient, steps, changes, rhos, count):
    """``-H g`` by the two-loop recursion over the ring buffer of pairs."""
    memory = steps.shape[0]

    def newest_first(i, carry):
        q, alphas = carry
        j = (count - 1 - i) % memory
        alpha = jnp.where(i < count, rhos[j] * jnp.dot(steps[j], q), 0.0)
        return q - alpha * changes[j], alphas.at[j].set(alpha)

    q, alphas = jax.lax.fori_loop(
        0, memory, newest_first, (gradient, jnp.zeros(memory, gradient.dtype))
    )
    newest = (count - 1) % memory
    curvature = jnp.dot(changes[newest], changes[newest])
    first_scale = 1.0 / jnp.maximum(jnp.linalg.norm(gradient), 1.0)
    scale = jnp.where(
        count > 0,
        jnp.dot(steps[newest], changes[newest]) / jnp.where(count > 0, curvature, 1.0),
        first_scale,
    )

    def oldest_first(i, r):
        position = count - memory + i
        j = position % memory
        beta = rhos[j] * jnp.dot(changes[j], r)
        return r + jnp.where(position >= 0, (alphas[j] - beta) * steps[j], 0.0)

    return -jax.lax.fori_loop(0, memory, oldest_first, scale * q)


def minimize(
    objective: Callable[[jax.Array], jax.Array], start: jax.Array, iterations: int
) -> jax.Array:
    """The minimiser of ``objective`` (of a flat ``[n]`` vector) from ``start``.

    Every step taken lowers the objective, or raises it by no more than
    rounding while its gradient shrinks, so the result is never worse than
    ``start`` beyond rounding. A NaN objective counts as no decrease.
    """
    value_and_grad = jax.value_and_grad(objective)
    dtype = start.dtype
    size = start.shape[0]
    value, gradient = value_and_grad(start)
    state = (
        jnp.asarray(0, jnp.int32),  # iteration
        jnp.asarray(False),  # stopped
        start,
        value,
        gradient,
        jnp.zeros((MEMORY, size), dtype),  # steps s
        jnp.zeros((MEMORY, size), dtype),  # gradient changes y
        jnp.zeros(MEMORY, dtype),  # 1 / (y . s)
        jnp.asarray(0, jnp.int32),  # pairs stored
    )

    def running(state):
        return (state[0] < iterations) & ~state[1]

    def iterate(state):
        step, _, x, value, gradient, steps, changes, rhos, count = state
        direction = _direction(gradient, steps, changes, rhos, count)
        slope = jnp.dot(gradient, direction)
        # Not a descent direction (rounding in a stale memory): steepest descent.
        restart = ~(slope < 0)
        direction = jnp.where(
            restart, -gradient / jnp.maximum(jnp.linalg.norm(gradient), 1.0), direction
        )
        slope = jnp.where(restart, jnp.dot(gradient, direction), slope)

        # A step is taken where it decreases the objective enough (Armijo),
        # or, near the minimum, where the objective cannot tell (no more than
        # rounding above) but the gradient shrinks: a float32 objective near 1
        # resolves ~1e-7, its gradient far finer (the approximate Wolfe
        # conditions of Hager & Zhang, 2005, in spirit). From the full step,
        # halved until one is.
        tolerance = 8 * jnp.finfo(dtype).eps * jnp.abs(value)
        gradient_norm = jnp.linalg.norm(gradient)

        def acceptable(length, trial, trial_gradient):
            return (trial <= value + _ARMIJO * length * slope) | (
                (trial <= value + tolerance)
                & (jnp.linalg.norm(trial_gradient) < gradient_norm)
            )

        def too_long(search):
            length, trial, trial_gradient, halvings = search
            return ~acceptable(length, trial, trial_gradient) & (halvings < _BACKTRACKS)

        def halve(search):
            length, _, _, halvings = search
            length = length / 2
            trial, trial_gradient = value_and_grad(x + length * direction)
            return length, trial, trial_gradient, halvings + 1

        one = jnp.asarray(1.0, dtype)
        length, new_value, new_gradient, _ = jax.lax.while_loop(
            too_long, halve, (one, *value_and_grad(x + direction), jnp.asarray(0))
        )
        found = acceptable(length, new_value, new_gradient)
        new_x = x + length * direction
        s, y = new_x - x, new_gradient - gradient
        sy = jnp.dot(s, y)
        keep = found & (sy > 0)
        slot = count % MEMORY
        steps = jnp.where(keep, steps.at[slot].set(s), steps)
        changes = jnp.where(keep, changes.at[slot].set(y), changes)
        rhos = jnp.where(keep, rhos.at[slot].set(1.0 / jnp.where(keep, sy, 1.0)), rhos)
        return (
            step + 1,
            ~found,
            jnp.where(found, new_x, x),
            jnp.where(found, new_value, value),
            jnp.where(found, new_gradient, gradient),
            steps,
            changes,
            rhos,
            count + keep.astype(jnp.int32),
        )

    return jax.lax.while_loop(running, iterate, state)[2]
