import os
from importlib.metadata import version

# Compiling is most of what this suite costs: thousands of small XLA programs,
# each run a few times on arrays of a few dozen elements. Two XLA settings make
# XLA's CPU backend compile them faster. Neither changes what is computed
# beyond rounding in the last bits, far inside every tolerance of
# tests/tolerances.py (both tiers pass with and without them):
# - LLVM's optimisation level 0 (about a fifth less compile time). The
#   results stay IEEE arithmetic (XLA asks LLVM for no fast-math at any
#   level); what changes is that LLVM then forms no fused multiply-adds.
# - On jaxlib before 0.11, XLA's older elementwise emitters instead of its
#   MLIR fusion emitters (XLA's default there): the CPU backend's compile
#   time about halves. Measured 2026-11-27 on jax 0.10.2: test_autodiff.py
#   and test_linear.py in one process, 35.3 s of backend compiles against
#   18.8 s; the quick tier, `pytest -n auto` on 2 cores, 470 s (14 min 55 s
#   of CPU) against 339 s (10 min 42 s). jaxlib 0.11 and later reject the
#   flag (tried: 0.11.2, 0.12.0.1); they compile with the fusion emitters.
# An XLA_FLAGS that sets either itself wins, e.g.
# XLA_FLAGS=--xla_backend_optimization_level=2 to test XLA's default. (Set
# before jax creates its CPU backend, which reads XLA_FLAGS once.)
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
    ).strip()
if "--xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and tuple(
    int(part) for part in version("jaxlib").split(".")[:2]
) < (0, 11):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_cpu_use_fusion_emitters=false"]
    ).strip()

import jax
import pytest

from ensembles.benchmark.cost import timing
from ensembles.ops import platform
from tests.formulations import FORMULATIONS, use_formulation
from tests.worker_exit import pytest_sessionfinish  # noqa: F401 (a hook)

# The suite never changes its own process's allocator: ensembles-bench's main
# and the benchmarks/ scripts call reuse_freed_memory(), which would give the
# rest of a worker's tests one malloc arena (slower steps). Here it sets
# nothing; what it does is tested in fresh processes
# (tests/test_benchmark_memory.py).
timing._KEEP_FREED = ()

# Implicit rank promotion hides shape bugs (an [E, out] bias silently broadcast
# against [E*B, out] outputs, say): make it an error everywhere in the tests.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache, for this run only.

    About one compile in ten repeats one another test (or the other xdist
    worker) already ran: the same program at the same shapes, from a layer
    built afresh. With the cache each is compiled once per run: the quick
    tier takes about a tenth less CPU (measured: 13 min 16 s against 14 min
    44 s of CPU, 2026-11-27). The cache lives in this run's temporary
    directory, which the workers share (pytest keeps the last three runs'):
    a run never reads another run's programs, so what a run measures is that
    run's compiles. Set before the first test; compiles at collection (none
    today) would go uncached, nothing else. JAX writes an entry in place: a
    worker reading one the other is still writing gets a UserWarning from
    JAX ("Error reading persistent compilation cache entry") and compiles,
    as it would have without the cache.
    """
    from jax.experimental.compilation_cache import compilation_cache

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, above the workers' own
    settings = {
        "jax_compilation_cache_dir": str(base / "jax-compilation-cache"),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    previous = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # decided at the first compile: decide again
    yield
    for name, value in previous.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drops JAX's in-memory caches of compiled programs after each module.

    A worker keeps every program it compiled while any cache holds it: over
    the quick tier a worker grew to 4.6 GB on jax 0.10.2 (measured
    2026-11-29), and over both tiers on jax 0.12 the two workers, beside the
    8-device subprocesses, came near the CI machine's 24 GiB (a worker died
    mid-run, "node down: Not properly terminated"). Programs are rarely shared
    between modules, and one that is comes back from the run's persistent
    cache (:func:`_compilation_cache`), not from XLA.
    """
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _rank_promotion_raise():
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(params=platform.FORMULATIONS)
def formulation(request, monkeypatch):
    """Runs a test once with each platform's formulation (``use_formulation``)."""
    use_formulation(monkeypatch, request.param)
    yield request.param
    jax.clear_caches()


@pytest.fixture(params=FORMULATIONS)
def every_formulation(request, monkeypatch):
    """Runs a test with each platform's formulation and the sharded one."""
    use_formulation(monkeypatch, request.param)
    yield request.param
    jax.clear_caches()


@pytest.fixture
def x64():
    """Enables float64 for one test (and restores the setting)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


# Parametrized sweeps the quick tier thins: it runs every `stride`-th case of
# each (in collection order: the first, then every stride-th after it), the
# slow tier every case, so the README's command stays under five minutes
# while each sweep still runs a spread of its cases there. CI runs both.
# {file under tests/: {test function: stride}}; tests/test_tiers.py checks
# that every name here is a test.
THINNED_SWEEPS = {
    "experimental/test_pallas_hopper.py": {"test_forward_matches_per_member_loop": 3},
    "layers/test_base.py": {
        "test_a_member_view_takes_one_example_as_the_flax_layer_does": 3,
        "test_a_flax_contract_promote_dtype_survives_conversion": 2,
    },
    "layers/test_conv.py": {
        "test_outputs_and_gradients_match_flax_per_member": 4,
        "test_an_empty_spatial_axis_gives_what_flax_gives": 2,
    },
    "layers/test_einsum.py": {
        "test_forward_matches_flax_einsum_per_member": 3,
        "test_gradients_match_jax_grad_of_flax_reference": 2,
        "test_member_view_and_extracted_member_match_reference": 3,
    },
    "layers/test_linear.py": {"test_forward_matches_flax_linear_per_member": 3},
    "layers/test_linear_general.py": {
        "test_forward_matches_flax_linear_general_per_member": 3,
        "test_gradients_match_jax_grad_of_flax_reference": 3,
    },
    "layers/test_ensemble_linear.py": {"test_matches_a_loop_of_linear_layers": 2},
    "layers/test_normalization.py": {
        "test_per_sample_gradients_match_jax_grad_of_flax_reference": 2,
        "test_per_sample_norms_match_flax_per_member": 3,
        "test_batch_norm_training_matches_flax_per_member": 2,
    },
    "ops/test_autodiff.py": {
        "test_float64_gradients_are_float64_accurate": 8,
        "test_jvp_and_linearize_float64": 8,
        "test_every_matmul_runs_at_the_requested_precision": 2,
        "test_jvp_in_float32_and_bfloat16": 2,
    },
    "ops/test_dense.py": {
        "test_gradients_match_per_member_loop": 3,
        "test_every_impl_gives_the_same_answer": 2,
        "test_forward_matches_per_member_loop": 3,
    },
    "ops/test_derivatives.py": {
        "test_conv_every_differentiated_subset": 3,
        "test_conv_shapes_options_members_jit": 4,
        "test_conv_through_batch_ensemble_conv": 2,
        "test_dense_gradients_equal_jax_of_the_plain_formula": 3,
        "test_dense_every_differentiated_subset": 3,
        "test_dense_shapes_members_ragged_jit": 3,
        "test_dense_shapes_members_ragged_eager": 2,
    },
    "ops/test_einsum.py": {
        "test_forward_matches_flax_einsum_per_member": 3,
        "test_gradients_match_jax_grad_of_reference": 4,
    },
    "test_benchmark.py": {"test_every_method_runs": 2},
    "test_benchmark_quality.py": {"test_models_fit_every_task": 2},
    "test_labels.py": {
        "test_cross_entropy_of_every_integer_dtype": 2,
        "test_metrics_of_every_integer_dtype": 4,
    },
    "test_rank1.py": {"test_eval_equals_a_batch_ensemble_holding_the_means": 3},
    "test_sharding.py": {"test_grouped_formulation_matches_one_device": 3},
    "test_calibrators.py": {"test_parametric_calibrators_equal_scipys_minimum": 2},
    "test_conformal_sets.py": {"test_thresholds_and_sets_equal_the_reference": 2},
    "test_uncertainty_edges.py": {"test_jit_equals_eager": 2},
    "test_uncertainty.py": {
        "test_ece_matches_explicit_bin_loop": 2,
        "test_per_example_measures_match_numpy": 2,
    },
    "test_uncertainty_regression.py": {
        "test_bfloat16_and_float64_inputs": 2,
        "test_invalid_entries_give_nan_there_only": 2,
        "test_scores_are_nan_if_any_entry_is_invalid_and_jit": 2,
    },
    "test_uncertainty_metrics.py": {
        "test_adaptive_ece_matches_array_split_bins": 3,
        "test_aurc_and_augrc_match_numpy": 2,
        "test_mce_matches_explicit_bin_loop": 3,
    },
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks
def pytest_collection_modifyitems(config, items):
    tests = config.rootpath / "tests"
    seen: dict[tuple[str, str], int] = {}
    for item in items:
        if not item.path.is_relative_to(tests):
            continue  # a doctest of src/
        path = item.path.relative_to(tests).as_posix()
        stride = THINNED_SWEEPS.get(path, {}).get(item.originalname)
        if stride is None:
            continue
        key = (path, item.originalname)
        index = seen[key] = seen.get(key, -1) + 1
        if index % stride:
            item.add_marker(pytest.mark.slow)
