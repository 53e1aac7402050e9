"""Tests of the ``ensembles-bench`` command and its methods (tiny sizes)."""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles.benchmark import (
    LEARNING_RATE,
    METHODS,
    MODES,
    NUM_CLASSES,
    build_model,
    cli,
    main,
    model_inputs,
    prepare_method,
    run_benchmark,
)
from ensembles.benchmark.cost import report
from tests.covering import covering
from tests.tolerances import assert_close

E, B, WIDTH, IMAGE = 2, 3, 4, 6
TINY = {"num_members": E, "batch": B, "width": WIDTH, "image_size": IMAGE}
TINY_ARGS = [
    "--model",
    "linear",
    "--members",
    "2",
    "--batch",
    "2",
    "--width",
    "4",
    "--repeats",
    "2",
]


MODELS = ["linear", "mlp", "cnn"]


@functools.cache
def _forward(method, model, ones=False):
    """Forward steps are pure, so tests share one compiled method per case."""
    init = ensembles.initializers.ones() if ones else None
    return prepare_method(method, model, "forward", fast_weight_init=init, **TINY)


def _outputs(model):
    return WIDTH if model == "linear" else NUM_CLASSES


# ---------------------------------------------------------------- arguments


def test_defaults_and_quick():
    args = cli._parse([])
    assert args.model == ("mlp",)
    assert args.mode == ("forward", "train")
    assert args.members == (1, 2, 4, 8)
    assert (args.batch, args.repeats, args.impl) == (128, 10, "xla")
    quick = cli._parse(["--quick"])
    assert (quick.members, quick.repeats) == ((1, 4), 5)
    # --quick only fills in what the line leaves out.
    given = cli._parse(["--quick", "--members", "3", "--repeats", "7"])
    assert (given.members, given.repeats) == ((3,), 7)


def test_lists_parse():
    args = cli._parse(
        ["--model", "linear,mlp", "--mode", "train", "--members", " 8, 2,8"]
    )
    assert args.model == ("linear", "mlp")
    assert args.mode == ("train",)
    assert args.members == (8, 2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--members", "0"], "every ensemble size E must be >= 1"),
        (["--members", "1,-2"], "every ensemble size E must be >= 1"),
        (["--members", "1,x"], "comma-separated list of integers"),
        (["--members", "2.5"], "comma-separated list of integers"),
        (
            ["--model", "resnet"],
            "--model resnet: choose from linear, mlp, cnn or name your own",
        ),
        (["--mode", "forward,eval"], "unknown 'eval'; choose from forward, train"),
        (["--impl", "cuda"], "invalid choice: 'cuda'"),
        (["--batch", "0"], "must be an integer >= 1, got 0"),
        (["--repeats", "two"], "must be an integer >= 1, got 'two'"),
        (["--plot", "out.pdf"], "must end in .png"),
    ],
)
def test_bad_arguments_exit_with_message(capsys, argv, message):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "ensembles-bench: error:" in err
    assert message in err


@pytest.mark.skipif(
    "pallas" not in ensembles.ops.IMPLS, reason="no Pallas dense op to refuse"
)
def test_impl_the_conv_lacks(capsys):
    # The dense op has a Pallas kernel, the conv op has not: the CNN refuses,
    # in one line, before anything is timed.
    assert main(["--model", "cnn", "--impl", "pallas"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "ensembles-bench: error: --model cnn --impl pallas: impl='pallas' is not "
        "available"
    ), err


def test_the_table_explains_its_ratio_columns():
    rows = run_benchmark(
        models=["linear"], modes=["forward"], members=[2], batch=2, width=4, repeats=1
    )
    legend = (
        "x 1 on E*B: the row's median over one plain model's on all E*B rows "
        "(the same matmuls: the limit; above 1, slower); x 1 on B: over one "
        "plain model's on one member's B rows (what a prediction costs without "
        "an ensemble: E members cost about E times its FLOPs)."
    )
    for text, gap in (
        (report.format_table(rows), "\n"),
        (report.format_markdown(rows), "\n\n"),
    ):
        table_end = text.index("| deep_ensemble_loop |" if gap == "\n\n" else "loop")
        assert gap + legend in text[table_end:], text


def test_plot_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as raised:
        main([*TINY_ARGS, "--plot", str(tmp_path / "out.png")])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err
    assert "pip install 'flax-ensembles[bench]'" in err
    assert not (tmp_path / "out.png").exists()


def test_train_without_optax(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "optax", None)
    with pytest.raises(SystemExit) as raised:
        main([*TINY_ARGS, "--mode", "train"])
    assert raised.value.code == 2
    assert "--mode train needs optax" in capsys.readouterr().err


def test_impl_choices_are_the_ops():
    action = next(
        a for a in cli.build_parser()._actions if a.option_strings == ["--impl"]
    )
    assert tuple(action.choices) == ensembles.ops.IMPLS


# ------------------------------------------------------------------ methods


# Every method on every model forward (one compiled program each, shared with
# the tests below through `_forward`). Trained (each case compiles a training
# step of its own): every method on the MLP, two methods on each other model.
# 20 of the 24 combinations, every pair of values of any two axes covered.
RUN_CASES = covering(
    {"model": MODELS, "method": list(METHODS), "mode": list(MODES)},
    [(model, method, "forward") for model in MODELS for method in METHODS]
    + [("mlp", method, "train") for method in METHODS]
    + [
        ("cnn", "batchensemble", "train"),
        ("cnn", "deep_ensemble_loop", "train"),
        ("linear", "single", "train"),
        ("linear", "deep_ensemble", "train"),
    ],
)


@pytest.mark.parametrize("model, method, mode", RUN_CASES)
def test_every_method_runs(model, method, mode):
    if mode == "forward":
        prepared = _forward(method, model)
    else:
        prepared = prepare_method(method, model, mode, **TINY)
    assert prepared.method == method
    first = prepared.step()
    if mode == "forward":
        rows = B if method == "single_b" else E * B  # single_b: one member's
        assert first.shape == (rows, _outputs(model))
        assert bool(jnp.all(jnp.isfinite(first)))
        # Forward steps are pure: the same inputs give the same outputs.
        assert_close(prepared.step(), first)
    else:
        losses = np.asarray(first)
        expected = (E,) if method.startswith("deep") else ()
        assert losses.shape == expected
        assert np.all(np.isfinite(losses)) and np.all(losses > 0)
        before = jax.tree.map(np.asarray, prepared.params())
        prepared.step()
        after = jax.tree.map(np.asarray, prepared.params())
        changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), before, after)
        assert all(jax.tree.leaves(changed)), "adam must update every parameter"
    memory = prepared.memory
    assert memory.argument_bytes >= prepared.param_bytes > 0
    assert memory.output_bytes > 0 and memory.temp_bytes >= 0
    assert memory.total_bytes == (
        memory.argument_bytes
        + memory.output_bytes
        - memory.alias_bytes
        + memory.temp_bytes
    )


@pytest.mark.parametrize("model", MODELS)
def test_parameter_counts(model):
    counts = {method: _forward(method, model).num_params for method in METHODS}
    single = counts["single"]
    assert single == sum(
        np.size(x)
        for x in jax.tree.leaves(
            nnx.state(build_model(model, width=WIDTH, rngs=nnx.Rngs(0)))
        )
    )
    assert counts["deep_ensemble"] == counts["deep_ensemble_loop"] == E * single
    # BatchEnsemble adds r [E, in], s [E, out] and E-1 more biases per layer.
    layers = [
        node
        for _, node in nnx.iter_graph(build_model(model, width=WIDTH, rngs=nnx.Rngs(0)))
        if isinstance(node, nnx.Linear | nnx.Conv)
    ]
    extra = sum(
        E * (layer.in_features + layer.out_features) + (E - 1) * layer.out_features
        for layer in layers
    )
    assert counts["batchensemble"] == single + extra
    # rank1 adds the posterior scales of r and s.
    scales = sum(E * (layer.in_features + layer.out_features) for layer in layers)
    assert counts["rank1"] == counts["batchensemble"] + scales


@pytest.mark.slow
def test_rank1_train_step_loss_is_cross_entropy_plus_kl_per_row():
    optax = pytest.importorskip("optax")
    prepared = prepare_method("rank1", "mlp", "train", **TINY)
    model = ensembles.to_batch_ensemble(
        build_model("mlp", width=WIDTH, rngs=nnx.Rngs(0)),
        num_members=E,
        rngs=nnx.Rngs(10_000),
        posterior="gaussian",
    )
    x, y = model_inputs("mlp", E * TINY["batch"], width=WIDTH, seed=0)
    logits = nnx.clone(model)(x)  # the draw the first step makes
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    expected = expected + ensembles.kl_divergence(model) / x.shape[0]
    assert_close(prepared.step(), expected)
    # The forward draws: it differs from batchensemble's (the means).
    assert not np.allclose(
        _forward("rank1", "mlp").step(), _forward("batchensemble", "mlp").step()
    )


def test_impl_view_computes_the_same():
    # The default and an explicit "xla" through nnx.view.
    prepared = prepare_method("batchensemble", "mlp", "forward", impl="xla", **TINY)
    assert_close(prepared.step(), _forward("batchensemble", "mlp").step())


# ------------------------------------------- the methods compute the same


@pytest.mark.parametrize("model", MODELS)
def test_forward_batchensemble_with_ones_equals_single(model):
    single = _forward("single", model)
    ensemble = _forward("batchensemble", model, ones=True)
    assert_close(ensemble.step(), single.step())
    # With the default fast weights the members differ from the plain model.
    default = _forward("batchensemble", model)
    assert not np.allclose(default.step(), single.step(), atol=1e-3)


@pytest.mark.parametrize("model", MODELS)
def test_forward_deep_ensemble_vmap_equals_loop(model):
    vmapped = _forward("deep_ensemble", model).step()
    looped = _forward("deep_ensemble_loop", model).step()
    assert_close(vmapped, looped)
    # Model 0 is the single model, on its own slice; model 1 is another model.
    single = _forward("single", model).step()
    assert_close(looped[:B], single[:B])
    assert not np.allclose(looped[B:], single[B:], atol=1e-3)


def test_train_batchensemble_with_ones_equals_single():
    ones = ensembles.initializers.ones()
    single = prepare_method("single", "mlp", "train", **TINY)
    ensemble = prepare_method(
        "batchensemble", "mlp", "train", fast_weight_init=ones, **TINY
    )
    assert_close(ensemble.step(), single.step())
    # Every member is the plain model, so the shared kernels get its gradient
    # and the same first adam update.
    for k in (0, 2, 4):
        assert_close(
            ensemble.params()["layers"][k]["kernel"][...],
            single.params()["layers"][k]["kernel"][...],
        )


def test_train_deep_ensemble_vmap_equals_loop():
    vmapped = prepare_method("deep_ensemble", "mlp", "train", **TINY)
    looped = prepare_method("deep_ensemble_loop", "mlp", "train", **TINY)
    for _ in range(3):
        assert_close(vmapped.step(), np.stack(looped.step()))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *looped.params())
    jax.tree.map(assert_close, vmapped.params(), stacked)
    losses = np.asarray(vmapped.step())
    assert losses[0] != losses[1]


# ---------------------------------------------------------------- the command


@pytest.mark.slow  # the command, end to end
def test_main_json_and_table(capsys, tmp_path):
    path = tmp_path / "bench.json"
    assert main([*TINY_ARGS, "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "linear forward: B=2 per member, width 4" in out
    assert "linear train: B=2 per member, width 4" in out
    for method in METHODS:
        assert method in out
    assert "[2/2] linear train E=2: timing 2 rounds" in err
    result = json.loads(path.read_text())
    assert set(result) >= {"device", "versions", "config", "results"}
    assert result["device"]["platform"] == jax.devices()[0].platform
    assert result["versions"]["jax"] == jax.__version__
    assert result["versions"]["ensembles"] == ensembles.__version__
    assert result["config"]["members"] == [2]
    rows = result["results"]
    assert [(r["mode"], r["method"]) for r in rows] == [
        (mode, method) for mode in MODES for method in METHODS
    ]
    for row in rows:
        assert (row["model"], row["members"], row["batch"], row["impl"]) == (
            "linear",
            2,
            2,
            "xla",
        )
        assert row["median_s"] > 0 and len(row["times_s"]) == 2
        assert row["q1_s"] <= row["median_s"] <= row["q3_s"]
        samples = 2 if row["method"] == "single_b" else 4  # B, or E*B
        assert row["samples_per_s"] == pytest.approx(samples / row["median_s"])
        assert isinstance(row["params"], int) and row["params"] > 0
        assert isinstance(row["temp_bytes"], int) and row["temp_bytes"] >= 0
        assert row["total_bytes"] > row["param_bytes"] >= 4 * row["params"]
    by_method = {(r["mode"], r["method"]): r for r in rows}
    for mode in MODES:
        single = by_method[mode, "single"]
        vmap = by_method[mode, "deep_ensemble"]
        loop = by_method[mode, "deep_ensemble_loop"]
        assert single["ratio_to_single"] == 1.0
        assert vmap["speedup_vs_deep_ensemble"] == 1.0
        assert loop["speedup_vs_deep_ensemble_loop"] == 1.0
        assert vmap["params"] == 2 * single["params"]
        # "the deep ensemble" of the ratios is the faster of vmap and loop.
        best = min((vmap, loop), key=lambda r: r["median_s"])
        assert best["speedup_vs_best_deep_ensemble"] == 1.0
        assert best["params_ratio_to_deep_ensemble"] == 1.0
        for method in METHODS:
            row = by_method[mode, method]
            assert row["best_deep_ensemble"] == best["method"]
            # Every ratio is a ratio of the printed medians.
            m = row["median_s"]
            assert row["ratio_to_single"] == pytest.approx(m / single["median_s"])
            one_b = by_method[mode, "single_b"]["median_s"]
            assert row["ratio_to_single_b"] == pytest.approx(m / one_b)
            assert row["speedup_vs_deep_ensemble"] == pytest.approx(
                vmap["median_s"] / m
            )
            assert row["speedup_vs_deep_ensemble_loop"] == pytest.approx(
                loop["median_s"] / m
            )
            assert row["speedup_vs_best_deep_ensemble"] == pytest.approx(
                best["median_s"] / m
            )
            assert row["params_ratio_to_deep_ensemble"] == pytest.approx(
                row["params"] / best["params"]
            )
            assert row["memory_ratio_to_deep_ensemble"] == pytest.approx(
                row["total_bytes"] / vmap["total_bytes"]
            )
            # The table prints those ratios, and names the deep ensemble.
            line = next(
                line
                for line in out.split(f"linear {mode}:")[1].splitlines()
                if line.split()[1:2] == [method]
            )
            assert f"{row['ratio_to_single']:.2f}" in line.split()
            assert f"{row['speedup_vs_best_deep_ensemble']:.2f}x" in line.split()
        name = "vmap" if best["method"] == "deep_ensemble" else "loop"
        title = out.split(f"linear {mode}:")[1].splitlines()[0]
        assert f"against the faster deep ensemble (E=2: {name})" in title
        assert "'memory/vmap deep' against the vmapped one" in title


def test_main_markdown_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    argv = [*TINY_ARGS, "--mode", "forward", "--markdown", "--plot", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| E | method | ms | spread | samples/s |" in out
    assert "| 2 | batchensemble |" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_bench_impls_reports_every_impl_as_ratios(tmp_path):
    from benchmarks import bench_impls

    out = tmp_path / "impls.json"
    rows = bench_impls.main(
        ["--shapes", "2,8,16,24", "--repeats", "2", "--json", str(out)]
    )
    # On CPU: "xla" (the kernel only interprets here), two modes.
    assert {(row["impl"], row["mode"]) for row in rows} == {
        ("xla", mode) for mode in ("forward", "gradient")
    }
    assert all(row["vs_linear"] > 0 and row["vs_deep"] > 0 for row in rows)
    assert json.loads(out.read_text()) == rows


def small_cnn(rngs):
    """A user's own model, for --model tests.test_benchmark:small_cnn."""
    return nnx.Sequential(
        nnx.Conv(3, 4, (3, 3), rngs=rngs),
        nnx.relu,
        lambda x: x.mean(axis=(1, 2)),
        nnx.Linear(4, 5, rngs=rngs),
    )


@pytest.mark.slow
def test_a_users_model_through_run_benchmark():
    rows = run_benchmark(
        models=[small_cnn],
        input_shape=(6, 6, 3),
        modes=["forward", "train"],
        members=[2],
        batch=3,
        repeats=2,
    )
    assert {row["model"] for row in rows} == {"small_cnn"}
    assert [row["method"] for row in rows[: len(METHODS)]] == list(METHODS)
    by_method = {(r["mode"], r["method"]): r for r in rows}
    # The BatchEnsemble converted the user's conv and linear: fast weights.
    assert (
        by_method["forward", "batchensemble"]["params"]
        > by_method["forward", "single"]["params"]
    )
    assert (
        by_method["train", "deep_ensemble"]["params"]
        == 2 * by_method["train", "single"]["params"]
    )
    with pytest.raises(ValueError, match=r"`input_shape` must give one example"):
        run_benchmark(models=[small_cnn], modes=["forward"], members=[2], repeats=1)


QUICK_ONE_OUTPUT = ("single", "deep_ensemble")


def regressor(rngs):
    """A user's model with one output: ``[N, 3] -> [N, 1]``."""
    return nnx.Sequential(
        nnx.Linear(3, 4, rngs=rngs), nnx.relu, nnx.Linear(4, 1, rngs=rngs)
    )


# A spread in the quick tier; the slow tier runs every method.
@pytest.mark.parametrize(
    "method",
    [
        pytest.param(m, marks=[] if m in QUICK_ONE_OUTPUT else [pytest.mark.slow])
        for m in METHODS
    ],
)
def test_a_one_output_model_trains_on_the_squared_error(method):
    # A softmax cross-entropy over one output is identically 0: its train
    # steps used to be timed with no gradient at all. The reference: numpy's
    # squared error of the models as built, on the rows each gets.
    pytest.importorskip("optax")
    prepared = prepare_method(
        method, regressor, "train", num_members=E, batch=B, input_shape=(3,)
    )
    assert prepared.loss == "squared error"
    x, targets = model_inputs(regressor, E * B, input_shape=(3,))
    assert targets.dtype == jnp.float32 and targets.shape == (E * B,)
    before = [np.array(leaf) for leaf in jax.tree.leaves(prepared.params())]
    loss = np.asarray(prepared.step())
    after = [np.array(leaf) for leaf in jax.tree.leaves(prepared.params())]
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    if method in ("single", "deep_ensemble", "deep_ensemble_loop"):
        members = 1 if method == "single" else E
        rows = E * B if method == "single" else B
        expected = []
        for k in range(members):
            rows_k = slice(k * rows, (k + 1) * rows)
            outputs = np.asarray(regressor(nnx.Rngs(k))(x[rows_k]))[:, 0]
            expected.append(np.mean((outputs - np.asarray(targets[rows_k])) ** 2))
        assert_close(loss.reshape(-1), np.asarray(expected))
    else:
        assert float(np.mean(loss)) > 0.1


def test_a_classifier_still_trains_on_the_cross_entropy():
    pytest.importorskip("optax")
    prepared = prepare_method("single", "linear", "train", **TINY)
    assert prepared.loss == "softmax cross-entropy"
    assert _forward("single", "linear").loss is None
    _, labels = model_inputs("linear", E * B, width=WIDTH)
    assert labels.dtype == jnp.int32


@pytest.mark.slow
def test_run_benchmark_says_a_one_output_model_fits_the_squared_error():
    rows = run_benchmark(
        models=[regressor],
        input_shape=(3,),
        modes=["forward", "train"],
        members=[2],
        batch=2,
        repeats=1,
    )
    assert {row["loss"] for row in rows if row["mode"] == "train"} == {"squared error"}
    assert {row["loss"] for row in rows if row["mode"] == "forward"} == {None}
    table = report.format_table(rows)
    forward, train = table.split("\n\nregressor train")
    assert "squared error" not in forward
    assert "Trained on the squared error of the model's one output" in train


@pytest.mark.slow  # the command, end to end
def test_cli_takes_a_users_model(capsys):
    status = main(
        [
            "--model",
            "tests.test_benchmark:small_cnn",
            "--input-shape",
            "6,6,3",
            "--mode",
            "forward",
            "--members",
            "2",
            "--batch",
            "2",
            "--repeats",
            "1",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "small_cnn forward: B=2 per member, impl=xla" in out


def test_cli_names_what_is_wrong_with_a_users_model(capsys):
    for argv, message in (
        (["--model", "tests.test_benchmark:small_cnn"], "needs --input-shape"),
        (["--model", "tests.test_benchmark:nothing"], "has no callable 'nothing'"),
        (["--model", "no_such_module:f"], "cannot import 'no_such_module'"),
        (["--model", "x:f", "--input-shape", "3,0"], "--input-shape: must be"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err, argv


# ------------------------------------------- models with state of their own
# Dropout (an rng count), BatchNorm (running statistics) and a body of blocks
# stacked with nnx.vmap and applied with nnx.scan (flax's
# examples/nnx_toy_examples/06_scan_over_layers.py): state a train step updates
# under jax.grad, where Variables made at jit's trace level cannot be updated.


def dropout_mlp(rngs):
    return nnx.Sequential(
        nnx.Linear(6, 8, rngs=rngs),
        nnx.relu,
        nnx.Dropout(0.1, rngs=rngs),
        nnx.Linear(8, 3, rngs=rngs),
    )


def batchnorm_mlp(rngs):
    return nnx.Sequential(
        nnx.Linear(6, 8, rngs=rngs),
        nnx.BatchNorm(8, rngs=rngs),
        nnx.relu,
        nnx.Dropout(0.1, rngs=rngs),
        nnx.Linear(8, 3, rngs=rngs),
    )


class _Block(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class _ScanMLP(nnx.Module):
    def __init__(self, dim, *, num_layers, rngs):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(axis_size=num_layers)
        def create_block(rngs):
            return _Block(dim, rngs=rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(dim, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan
        def body(x, block):
            return block(x), None

        x, _ = body(x, self.blocks)
        return self.head(x)


def scan_mlp(rngs):
    return _ScanMLP(6, num_layers=2, rngs=rngs)


STATEFUL = [dropout_mlp, batchnorm_mlp, scan_mlp]
# The quick tier checks the stacked body (its blocks hold all three kinds of
# state); the slow tier the two small models too.
STATEFUL_CASES = [
    pytest.param(dropout_mlp, marks=pytest.mark.slow),
    pytest.param(batchnorm_mlp, marks=pytest.mark.slow),
    scan_mlp,
]


@pytest.mark.slow  # 24 methods compiled and timed
def test_every_method_runs_on_models_with_dropout_batchnorm_and_scan():
    # The model (Dropout) and the stacked body (its blocks hold
    # Dropout and BatchNorm, under nnx.scan).
    models = [dropout_mlp, scan_mlp]
    rows = run_benchmark(
        models=models,
        input_shape=(6,),
        modes=list(MODES),
        members=[2],
        batch=3,
        repeats=2,
    )
    assert [(r["model"], r["mode"], r["method"]) for r in rows] == [
        (f.__name__, mode, method)
        for f in models
        for mode in MODES
        for method in METHODS
    ]
    assert all(r["median_s"] > 0 and r["params"] > 0 for r in rows)
    by_case = {(r["model"], r["mode"], r["method"]): r for r in rows}
    for f in models:
        # The converted model has fast weights: every layer was converted.
        assert (
            by_case[f.__name__, "train", "batchensemble"]["params"]
            > by_case[f.__name__, "train", "single"]["params"]
        )


def _reference_losses(factory, x, labels, steps):
    """What a user's nnx training loop gives: nnx.Optimizer under nnx.jit."""
    optax = pytest.importorskip("optax")
    model = factory(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, labels):
        def loss_fn(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, labels
            ).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [step(model, optimizer, x, labels) for _ in range(steps)]
    return losses, nnx.state(model, nnx.Param)


@pytest.mark.parametrize("factory", STATEFUL_CASES)
def test_train_step_is_a_users_training_loop(factory):
    # The step carries the rng counts and running statistics over: the
    # dropout masks of step 2 are not those of step 1, as in a training loop.
    prepared = prepare_method(
        "single", factory, "train", num_members=E, batch=B, input_shape=(6,)
    )
    x, labels = model_inputs(factory, E * B, input_shape=(6,))
    expected, params = _reference_losses(factory, x, labels, 3)
    for want in expected:
        assert_close(prepared.step(), want)
    jax.tree.map(assert_close, prepared.params(), params)


@pytest.mark.parametrize("factory", STATEFUL_CASES)
def test_train_deep_ensemble_vmap_equals_loop_with_state(factory):
    shape = {"num_members": E, "batch": B, "input_shape": (6,)}
    vmapped = prepare_method("deep_ensemble", factory, "train", **shape)
    looped = prepare_method("deep_ensemble_loop", factory, "train", **shape)
    for _ in range(3):
        assert_close(vmapped.step(), np.stack(looped.step()))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *looped.params())
    jax.tree.map(assert_close, vmapped.params(), stacked)


@pytest.mark.slow
@pytest.mark.parametrize("factory", STATEFUL)
def test_batchensemble_with_ones_equals_single_with_state(factory):
    # The converted model keeps the Dropout (its rng stream, so its masks) and
    # the BatchNorm of the user's model: with ones for fast weights every
    # member computes what the plain model does, forward and in the first
    # train step (afterwards adam moves the fast weights too).
    shape = {"num_members": E, "batch": B, "input_shape": (6,)}
    ones = ensembles.initializers.ones()
    for mode in MODES:
        single = prepare_method("single", factory, mode, **shape)
        ensemble = prepare_method(
            "batchensemble", factory, mode, fast_weight_init=ones, **shape
        )
        assert_close(ensemble.step(), single.step())


@pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="an option of XLA's CPU backend alone"
)
def test_bench_ynn_fusion_times_each_layer_with_and_without_the_option(
    monkeypatch, capsys
):
    from benchmarks import bench_ynn_fusion
    from benchmarks.bench_dense import build, compiled_step

    # What the script measures: by default the scalings and the bias are
    # fusions of their own around the dot; with the option, one fusion in all.
    layer = build("batchensemble", 2, 64, 64)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((128, 64)), jnp.float32)
    for options, fusions in ((None, 3), (bench_ynn_fusion.YNN_ELTWISE, 1)):
        step, params = compiled_step(layer, "forward", options)
        hlo = step.lower(params, x).compile().as_text()
        entry = hlo[hlo.index("ENTRY") :]
        assert entry.count("fusion(") == fusions, entry
        np.testing.assert_allclose(step(params, x), layer(x), rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(bench_ynn_fusion, "SHAPES", [(2, 4, 8, 8)])
    bench_ynn_fusion.main(["--repeats", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [row[:2] for row in rows] == [
        ["2x4x8x8", mode] for mode in ("forward", "train", "forward_backward")
    ]
    assert all(float(value) > 0 for row in rows for value in row[2:])
