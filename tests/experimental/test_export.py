"""A model exports (``jax.export``) for GPUs and TPUs from a machine with neither.

The default path is plain XLA: one artifact serves CPU, CUDA and TPU, and runs
here. With ``impl="pallas"`` the artifact holds a kernel's custom call, which
fixes its platform (``docs/fused_kernel.md``, "Exporting a model"):

* Triton's custom call (``__gpu$xla.gpu.triton``) is not among jax's
  export-stable ones: exporting for ``cuda`` needs
  ``DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")``; Mosaic TPU's
  ``tpu_custom_call`` is stable.
* One platform per artifact: jax lowers every platform's branch of a
  ``pallas_call`` for each platform asked for, and a kernel's compiler
  parameters refuse the others (jax-ml/jax#28594).
* jax 0.12 lowers Triton from a machine without a GPU only under an abstract
  mesh of a GPU device (``jax.sharding.use_abstract_mesh``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import ensembles

TRITON = "__gpu$xla.gpu.triton"
ALLOW_TRITON = [export.DisabledSafetyCheck.custom_call(TRITON)]
E = 2


class Model(nnx.Module):
    def __init__(self, rngs, impl="xla"):
        self.conv = ensembles.BatchEnsembleConv(3, 8, (3, 3), num_members=E, rngs=rngs)
        self.hidden = ensembles.BatchEnsembleLinear(
            8, 32, num_members=E, impl=impl, rngs=rngs
        )
        self.out = ensembles.BatchEnsembleLinear(
            32, 4, num_members=E, impl=impl, rngs=rngs
        )

    def __call__(self, x):
        h = nnx.relu(self.conv(x)).mean(axis=(1, 2))
        return self.out(nnx.relu(self.hidden(h)))


def flat(model):
    """The model as a function of flat arrays (an nnx State does not serialise)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    def apply(x, *leaves):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, list(leaves)))(x)

    return apply, leaves


def specs(x, leaves):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, *leaves)]


def custom_calls(exported):
    return set(re.findall(r"custom_call @([^(\s]+)\(", exported.mlir_module()))


def h100_mesh():
    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"
    )
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


X = jnp.asarray(np.random.default_rng(0).standard_normal((E * 3, 6, 6, 3)), jnp.float32)


def test_the_default_path_exports_for_cpu_cuda_and_tpu_at_once():
    model = Model(nnx.Rngs(0))
    apply, leaves = flat(model)
    exported = export.export(jax.jit(apply), platforms=["cpu", "cuda", "tpu"])(
        *specs(X, leaves)
    )
    assert custom_calls(exported) == set()  # plain XLA: no kernel
    restored = export.deserialize(exported.serialize())
    assert restored.platforms == ("cpu", "cuda", "tpu")
    np.testing.assert_allclose(
        restored.call(X, *leaves), jax.jit(apply)(X, *leaves), rtol=1e-6
    )


def test_pallas_exports_for_tpu_and_for_cuda_with_the_triton_check_disabled():
    apply, leaves = flat(Model(nnx.Rngs(0), impl="pallas"))
    arg_specs = specs(X, leaves)
    tpu = export.export(jax.jit(apply), platforms=["tpu"])(*arg_specs)
    assert custom_calls(tpu) == {"tpu_custom_call"}
    assert export.deserialize(tpu.serialize()).platforms == ("tpu",)
    with jax.sharding.use_abstract_mesh(h100_mesh()):
        # What a user meets first, then the fix the docs give.
        with pytest.raises(ValueError, match="no compatibility guarantees"):
            export.export(jax.jit(apply), platforms=["cuda"])(*arg_specs)
        cuda = export.export(
            jax.jit(apply), platforms=["cuda"], disabled_checks=ALLOW_TRITON
        )(*arg_specs)
    assert custom_calls(cuda) == {TRITON}
    assert export.deserialize(cuda.serialize()).platforms == ("cuda",)


def test_pallas_needs_one_artifact_per_platform():
    # A jax limit (jax-ml/jax#28594), which the docs state; if this starts to
    # pass, one artifact serves both and the docs should say so.
    apply, leaves = flat(Model(nnx.Rngs(0), impl="pallas"))
    with pytest.raises(ValueError, match="cannot be used for tpu lowering"):
        export.export(
            jax.jit(apply), platforms=["cuda", "tpu"], disabled_checks=ALLOW_TRITON
        )(*specs(X, leaves))


@pytest.mark.parametrize(
    "platforms, batched",
    [
        (["cuda"], [True]),
        (["tpu"], [True]),
        (["cpu"], [False]),
        (["cpu", "cuda"], [False, True]),
    ],
)
def test_each_platform_gets_its_formulation(platforms, batched):
    """The platform a program is lowered for chooses the formulation
    (``ensembles.ops.platform``), not the machine's default backend: a CUDA or
    TPU program holds the members-as-batch matmul, a CPU one the flat matmul;
    an artifact for several holds each for its platform."""

    def dense(x, kernel, r, s):
        return ensembles.ops.batch_ensemble_dense(x, kernel, r, s, num_members=2)

    shapes = ((6, 4), (4, 5), (2, 4), (2, 5))
    exported = export.export(jax.jit(dense), platforms=platforms)(
        *[jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    )
    dots = {
        "batching_dims = [0] x [0]" in line
        for line in exported.mlir_module().splitlines()
        if "stablehlo.dot_general" in line
    }
    assert dots == set(batched)
