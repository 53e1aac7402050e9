"""Choosing the ops' formulation in a test, whatever platform the tests run on."""

import jax

from ensembles.ops import platform


def use_formulation(monkeypatch, name):
    """Makes the ops run formulation ``name`` whatever platform the tests run on.

    The ops choose theirs when a program is lowered
    (:func:`ensembles.ops.platform.by_platform`): on this CPU, the CPU's. The
    accelerators' is tested here on the CPU by choosing it instead. JAX's
    caches are cleared around it: a trace made under one formulation must not
    serve a test of the other.
    """
    assert name in platform.FORMULATIONS, name

    def chosen(*operands, cpu, accelerator):
        return {"cpu": cpu, "accelerator": accelerator}[name](*operands)

    monkeypatch.setattr(platform, "by_platform", chosen)
    jax.clear_caches()
