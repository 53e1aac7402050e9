"""Choosing the ops' formulation in a test, whatever platform the tests run on."""

import jax

from ensembles.ops import groups, platform

#: What a sharded program's ops are told of their rows in the ``"sharded"``
#: formulation: split 6 ways, so that E = 2, 3, 4 view them as 6 or 12 groups.
SHARDS = 6

#: Every formulation a test can choose: the platforms' own
#: (:data:`ensembles.ops.platform.FORMULATIONS`), and ``"sharded"``, the
#: grouped view a program whose rows may be split over devices gets
#: (:mod:`ensembles.ops.groups`), run here on one device.
FORMULATIONS = (*platform.FORMULATIONS, "sharded")


def use_formulation(monkeypatch, name):
    """Makes the ops run formulation ``name`` whatever platform the tests run on.

    The ops choose theirs when a program is lowered
    (:func:`ensembles.ops.platform.by_platform`): on this CPU, the CPU's. The
    accelerators' is tested here on the CPU by choosing it instead; the
    sharded one by telling the ops their rows are split :data:`SHARDS` ways.
    JAX's caches are cleared around it: a trace made under one formulation
    must not serve a test of another.
    """
    assert name in FORMULATIONS, name
    if name == "sharded":
        monkeypatch.setattr(groups, "row_shards", lambda inputs: SHARDS)
    else:

        def chosen(*operands, cpu, accelerator):
            return {"cpu": cpu, "accelerator": accelerator}[name](*operands)

        monkeypatch.setattr(platform, "by_platform", chosen)
    jax.clear_caches()
