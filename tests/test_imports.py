"""What ``import ensembles`` loads: no Pallas, Mosaic or Triton until asked for.

The fused kernels live in :mod:`ensembles.experimental.pallas`, imported only
when a call names ``impl="pallas"``: importing the library, or running its
default ``"xla"`` ops, must not pull in JAX's Pallas stack (its Triton and
Mosaic lowerings are heavy, and deprecated or absent on some installs). Each
check runs in a fresh interpreter, since this one has imported everything the
other tests did.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ensembles

FORBIDDEN = ("pallas", "mosaic", "triton")

SCRIPT = textwrap.dedent(
    """
    import json, sys

    import flax.nnx  # noqa: F401

    FORBIDDEN = {forbidden!r}


    def loaded(names):
        return sorted(
            name for name in names if any(word in name.lower() for word in FORBIDDEN)
        )


    def experimental():
        return sorted(
            name for name in sys.modules
            if name == "ensembles.experimental"
            or name.startswith("ensembles.experimental.")
        )


    import jax.numpy as jnp
    import numpy as np

    before = set(sys.modules)
    import ensembles

    out = {{
        "ensembles": ensembles.__file__,
        "by_import": loaded(set(sys.modules) - before),
        "experimental_after_import": experimental(),
    }}

    rng = np.random.default_rng(0)
    num_members, rows, in_features, out_features = 2, 3, 4, 5
    x = jnp.asarray(rng.standard_normal((num_members * rows, in_features)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((in_features, out_features)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((num_members, in_features)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((num_members, out_features)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((num_members, out_features)), jnp.float32)
    args = (x, kernel, r, s, bias)

    before = set(sys.modules)
    y_default = ensembles.ops.batch_ensemble_dense(*args, num_members=num_members)
    y_xla = ensembles.ops.batch_ensemble_dense(
        *args, num_members=num_members, impl="xla"
    )
    out["by_xla"] = loaded(set(sys.modules) - before)
    out["experimental_after_xla"] = experimental()

    y_pallas = ensembles.ops.batch_ensemble_dense(
        *args, num_members=num_members, impl="pallas", interpret=True
    )
    out["experimental_after_pallas"] = experimental()
    out["by_pallas"] = loaded(sys.modules)
    out["y_default"] = np.asarray(y_default).tolist()
    out["y_xla"] = np.asarray(y_xla).tolist()
    out["y_pallas"] = np.asarray(y_pallas).tolist()
    print("RESULT " + json.dumps(out))
    """
).format(forbidden=FORBIDDEN)


def _run():
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    return json.loads(lines[0].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def fresh():
    """What the script saw, in one fresh interpreter (run once per module)."""
    out = _run()
    # It imported this checkout's library, not another install.
    assert os.path.samefile(out["ensembles"], ensembles.__file__), out["ensembles"]
    return out


def test_import_loads_no_kernel_stack(fresh):
    # `import ensembles` (after flax.nnx) adds no Pallas/Mosaic/Triton module
    # and does not import ensembles.experimental.
    assert fresh["by_import"] == [], fresh["by_import"]
    assert fresh["experimental_after_import"] == []


def test_default_and_xla_ops_load_no_kernel_stack(fresh):
    assert fresh["by_xla"] == [], fresh["by_xla"]
    assert fresh["experimental_after_xla"] == []
    np.testing.assert_array_equal(fresh["y_default"], fresh["y_xla"])


def test_pallas_imports_the_kernels_and_matches_xla(fresh):
    # Naming impl="pallas" imports the kernels (so the checks above can fail)
    assert "ensembles.experimental.pallas" in fresh["experimental_after_pallas"]
    assert any("pallas" in name for name in fresh["by_pallas"]), fresh["by_pallas"]
    # ... and computes what "xla" does.
    assert np.asarray(fresh["y_xla"]).shape == (6, 5)
    np.testing.assert_allclose(fresh["y_pallas"], fresh["y_xla"], rtol=1e-5, atol=1e-5)
