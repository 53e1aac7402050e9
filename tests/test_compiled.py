"""The compiled-program reader and comparison (``benchmark.cost.compiled``).

On synthetic HLO written as XLA prints it (each backend's idioms: a TPU's
batched matmul as a base-dilated convolution, its on-chip memory spaces and
DMAs, a GPU's cuBLAS call and known trip counts), against numbers worked out
by hand; and on this machine's own CPU programs, against the shapes' flops.
The chips' own programs are the compile tier's
(``tests/experimental/test_compiled_cost.py``).
"""

import io
import operator
import re
from contextlib import redirect_stdout

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ensembles.benchmark import cli
from ensembles.benchmark.cost.compiled import chips
from ensembles.benchmark.cost.compiled.hlo import Kernel, Program, parse_program
from ensembles.benchmark.cost.compiled.hlo_text import parse_instruction
from ensembles.benchmark.cost.compiled.programs import (
    Comparison,
    ProgramCost,
    compare_programs,
    program_cost,
)
from ensembles.benchmark.cost.compiled.report import format_comparisons


def module(*lines, extra=""):
    return "\n".join(
        ["HloModule m", extra, "ENTRY %main (p: f32[1]) -> f32[1] {", *lines, "}"]
    )


def test_a_dot_s_flops_and_bytes():
    program = parse_program(
        module(
            "  %x = f32[8,4]{1,0} parameter(0)",
            "  %w = f32[4,2]{1,0} parameter(1)",
            "  ROOT %d = f32[8,2]{1,0} dot(%x, %w), lhs_contracting_dims={1}, "
            "rhs_contracting_dims={0}",
        )
    )
    (kernel,) = program.kernels
    assert (kernel.category, kernel.flops) == ("gemm", 2 * 8 * 2 * 4)
    assert kernel.hbm_bytes == 4 * (8 * 4 + 4 * 2 + 8 * 2)


def test_a_fusion_is_one_kernel_counted_by_its_body():
    program = parse_program(
        "\n".join(
            [
                "HloModule m",
                "%fused (a: bf16[16,32], b: bf16[32,8]) -> bf16[16,8] {",
                "  %a = bf16[16,32]{1,0} parameter(0)",
                "  %b = bf16[32,8]{1,0} parameter(1)",
                "  %d = bf16[16,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
                "rhs_contracting_dims={0}",
                "  ROOT %m = bf16[16,8]{1,0} multiply(%d, %d)",
                "}",
                "ENTRY %main (x: bf16[16,32], w: bf16[32,8]) -> bf16[16,8] {",
                "  %x = bf16[16,32]{1,0} parameter(0)",
                "  %w = bf16[32,8]{1,0} parameter(1)",
                "  ROOT %f = bf16[16,8]{1,0} fusion(%x, %w), kind=kCustom, "
                'calls=%fused, metadata={op_name="jit(f)/dot_general"}',
                "}",
            ]
        )
    )
    (kernel,) = program.kernels
    assert kernel.ops == ("dot", "multiply")
    assert kernel.flops == 2 * 16 * 8 * 32
    assert kernel.hbm_bytes == 2 * (16 * 32 + 32 * 8 + 16 * 8)
    assert kernel.op_name == "jit(f)/dot_general"


def test_a_tpu_batched_matmul_counts_one_tap_per_output():
    """A TPU prints ``[E, B, in] x [E, in, out]`` as a base-dilated convolution
    over E whose window sees one real input per output: a matmul's flops."""
    e, b, i, o = 4, 256, 64, 32
    program = parse_program(
        module(
            f"  %x = bf16[{e},{b},{i}]{{2,1,0}} parameter(0)",
            f"  %w = bf16[{e},{i},{o}]{{2,1,0}} parameter(1)",
            f"  ROOT %c = bf16[{e},{b},{o}]{{2,1,0}} convolution(%x, %w), "
            f"window={{size={e} stride={e - 1} lhs_dilate={e}}}, "
            f"dim_labels=0bf_0io->0bf",
        )
    )
    (kernel,) = program.kernels
    assert kernel.category == "gemm"
    assert kernel.flops == 2 * e * b * i * o


def test_a_real_convolution_counts_its_window():
    """3x3 SAME on 5x5: the taps landing on real pixels, padding left out."""
    program = parse_program(
        module(
            "  %x = f32[2,5,5,3]{3,2,1,0} parameter(0)",
            "  %w = f32[3,3,3,4]{3,2,1,0} parameter(1)",
            "  ROOT %c = f32[2,5,5,4]{3,2,1,0} convolution(%x, %w), "
            "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f",
        )
    )
    (kernel,) = program.kernels
    # Per axis, 5 outputs x 3 taps less the 2 that fall on padding: 13.
    assert kernel.category == "conv"
    assert kernel.flops == 2 * 2 * 4 * 3 * 13 * 13


def test_on_chip_buffers_and_dmas():
    """S(1) (a TPU's on-chip memory) is no main-memory traffic; a DMA moves
    its destination once and is no kernel."""
    program = parse_program(
        module(
            "  %x = f32[256,128]{1,0:T(8,128)} parameter(0)",
            "  %cs = (f32[256,128]{1,0:T(8,128)S(1)}, f32[256,128]{1,0:T(8,128)}, "
            "u32[]{:S(2)}) copy-start(%x)",
            "  %cd = f32[256,128]{1,0:T(8,128)S(1)} copy-done(%cs)",
            "  ROOT %n = f32[256,128]{1,0:T(8,128)} negate(%cd)",
        )
    )
    dma, negate = program.kernels
    assert (dma.category, dma.hbm_bytes) == ("dma", 256 * 128 * 4)
    assert negate.hbm_bytes == 256 * 128 * 4  # its output only
    assert program.launches == 1


def test_an_in_place_update_moves_the_update_only():
    text = "\n".join(
        [
            "HloModule m",
            "%dus (buf: f32[100,64], upd: f32[1,64], i: s32[]) -> f32[100,64] {",
            "  %buf = f32[100,64]{1,0} parameter(0)",
            "  %upd = f32[1,64]{1,0} parameter(1)",
            "  %i = s32[] parameter(2)",
            "  %z = s32[] constant(0)",
            "  ROOT %u = f32[100,64]{1,0} dynamic-update-slice(%buf, %upd, %i, %z)",
            "}",
            "ENTRY %main (b: f32[100,64], u: f32[1,64], i: s32[]) -> f32[100,64] {",
            "  %b = f32[100,64]{1,0} parameter(0)",
            "  %u = f32[1,64]{1,0} parameter(1)",
            "  %i = s32[] parameter(2)",
            "  ROOT %f = f32[100,64]{1,0} fusion(%b, %u, %i), kind=kLoop, calls=%dus",
            "}",
        ]
    )
    (kernel,) = parse_program(text).kernels
    assert kernel.hbm_bytes == 64 * 4 + 64 * 4 + 4  # update in and out, index


def test_a_loop_counts_its_body_per_trip():
    text = "\n".join(
        [
            "HloModule m",
            "%body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {",
            "  %t = (s32[], f32[8,8]{1,0}) parameter(0)",
            "  %c = f32[8,8]{1,0} get-tuple-element(%t), index=1",
            "  %d = f32[8,8]{1,0} dot(%c, %c), lhs_contracting_dims={1}, "
            "rhs_contracting_dims={0}",
            "  %n = s32[] get-tuple-element(%t), index=0",
            "  ROOT %r = (s32[], f32[8,8]{1,0}) tuple(%n, %d)",
            "}",
            "%cond (t: (s32[], f32[8,8])) -> pred[] {",
            "  %t = (s32[], f32[8,8]{1,0}) parameter(0)",
            "  %n = s32[] get-tuple-element(%t), index=0",
            "  %k = s32[] constant(7)",
            "  ROOT %lt = pred[] compare(%n, %k), direction=LT",
            "}",
            "ENTRY %main (x: f32[8,8]) -> (s32[], f32[8,8]) {",
            "  %x = f32[8,8]{1,0} parameter(0)",
            "  %z = s32[] constant(0)",
            "  %t = (s32[], f32[8,8]{1,0}) tuple(%z, %x)",
            "  ROOT %w = (s32[], f32[8,8]{1,0}) while(%t), condition=%cond, body=%body",
            "}",
        ]
    )
    program = parse_program(text)
    assert program.loops == (("w", 7),)
    assert program.flops == 7 * 2 * 8 * 8 * 8
    # A GPU's compiler states the count instead.
    known = text.replace(
        "body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"3"}}'
    )
    assert parse_program(known).loops == (("w", 3),)


def test_library_calls_and_their_workspace():
    program = parse_program(
        module(
            "  %a = f32[64,32]{1,0} parameter(0)",
            "  %b = f32[32,16]{1,0} parameter(1)",
            "  ROOT %g = (f32[64,16]{1,0}, s8[4194304]{0}) custom-call(%a, %b), "
            'custom_call_target="__cublas$gemm", lhs_contracting_dims={1}',
        )
    )
    (kernel,) = program.kernels
    assert (kernel.category, kernel.flops) == ("gemm", 2 * 64 * 16 * 32)
    assert kernel.hbm_bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)  # no workspace


def test_source_lines_come_from_the_stack_frame_tables():
    tables = "\n".join(
        [
            "FileNames",
            '1 "/x/site-packages/ensembles/ops/dense.py"',
            "FunctionNames",
            '1 "dense_rows"',
            "FileLocations",
            "1 {file_name_id=1 function_name_id=1 line=42 end_line=42}",
            "StackFrames",
            "1 {file_location_id=1 parent_frame_id=1}",
        ]
    )
    program = parse_program(
        module(
            "  %x = f32[4]{0} parameter(0)",
            "  ROOT %n = f32[4]{0} negate(%x), metadata={stack_frame_id=1}",
            extra=tables,
        )
    )
    assert program.kernels[0].source == "ensembles/ops/dense.py:42 (dense_rows)"


def test_an_instruction_printed_with_a_tuple_shape_and_quotes():
    instruction = parse_instruction(
        '  %t = (f32[2]{0}, s32[]) custom-call(%a), custom_call_target="x(y)", '
        'metadata={op_name="a{b}"}'
    )
    assert instruction.opcode == "custom-call"
    assert [a.bytes for a in instruction.shape] == [8, 4]
    assert instruction.attribute("custom_call_target") == "x(y)"


def test_no_entry_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        parse_program("HloModule m\n")


# --- this machine's own programs ------------------------------------------------


def test_a_cpu_scan_program():
    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]

    spec = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    cost = program_cost("cpu", f, [spec, spec])
    assert cost.program.loops[0][1] == 5
    assert cost.flops == 5 * 2 * 32**3
    assert cost.loops == 1 and cost.loop_trips == 5


def test_the_cpu_comparison_of_a_dense_layer():
    row = compare_programs("linear", "forward", chip="cpu", num_members=2, batch=4,
                           width=8)  # fmt: skip
    assert row.plain.flops == row.ensemble.flops == 2 * 8 * 8 * 8
    assert row.ratio("flops") == 1.0
    assert row.ensemble.matmul_launches == row.plain.matmul_launches == 1
    record = row.as_dict()
    assert record["batchensemble"]["flops"] == row.ensemble.flops
    assert record["chip"] == "cpu"


def test_extra_kernels_name_what_the_ensemble_adds():
    """A program with one elementwise pass more than another: that pass, with
    its source line, is the one extra kernel."""
    spec = jax.ShapeDtypeStruct((64, 64), jnp.float32)

    def plain(x, w):
        return x @ w

    def more(x, w):
        return jnp.sin(x @ w) @ w

    row = Comparison(
        "m", "forward", "float32", 1, 64,
        ensemble=program_cost("cpu", more, [spec, spec]),
        plain=program_cost("cpu", plain, [spec, spec]),
    )  # fmt: skip
    extra = row.extra_kernels()
    assert any(k.category == "gemm" for k in extra)
    assert all("test_compiled.py" in (k.source or "") for k in extra), extra
    same = Comparison("m", "forward", "float32", 1, 64, row.plain, row.plain)
    assert same.extra_kernels() == []


def test_a_missing_compiler_says_what_to_install(monkeypatch):
    def missing(chip, num_devices):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(chips, "_topology_devices", missing)
    with pytest.raises(RuntimeError, match=r"jax-cuda12-plugin==.*JAX_PLATFORMS=cpu"):
        chips.chip_mesh("h100")
    with pytest.raises(RuntimeError, match=re.escape("jax[tpu]==")):
        chips.chip_mesh("v5e")
    with pytest.raises(ValueError, match="`chip` must be one of"):
        chips.chip_mesh("h200")


# --- the command --------------------------------------------------------------


def test_the_command_compares_for_a_chip():
    out = io.StringIO()
    with redirect_stdout(out):
        status = cli.main(
            ["--compiled-for", "cpu", "--model", "linear", "--width", "8",
             "--batch", "2", "--members", "2", "--mode", "forward,train",
             "--dtype", "float32,bfloat16", "--markdown"]
        )  # fmt: skip
    assert status == 0
    text = out.getvalue()
    table = [line for line in text.splitlines() if line.startswith("| cpu ")]
    assert len(table) == 4, text
    assert "Kernels the BatchEnsemble adds" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--compiled-for", "cpu", "--repeats", "3"], "--repeats does not apply"),
        (["--compiled-for", "cpu", "--quality"], "two benchmarks"),
        (["--dtype", "bfloat16"], "--dtype applies with --compiled-for only"),
        (["--compiled-for", "tpu9"], "unknown 'tpu9'"),
        (["--compiled-for", "cpu", "--dtype", "float16"], "unknown 'float16'"),
    ],
)
def test_the_command_refuses_what_does_not_apply(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_compiler_is_a_clear_error(monkeypatch, capsys):
    def missing(chip, num_devices):
        raise NotImplementedError("no plugin")

    monkeypatch.setattr(chips, "_topology_devices", missing)
    argv = ["--compiled-for", "h100", "--model", "linear", "--width", "8",
            "--batch", "2", "--members", "2", "--mode", "forward"]  # fmt: skip
    status = cli.main(argv)
    assert status == 2
    assert "jax-cuda12-plugin" in capsys.readouterr().err


def test_by_member_view_and_by_row_agree():
    """The two ways of applying per-member vectors compute the same."""
    from ensembles.members import by_member_view, by_row

    array = jnp.arange(24.0).reshape(6, 2, 2)
    weights = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    for op in (operator.mul, operator.add):
        assert jnp.array_equal(
            by_row(array, weights, op), by_member_view(array, weights, op)
        )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mode": "backward"}, "`mode` must be 'forward' or 'train'"),
        ({"mode": "forward", "dtype": "float16"}, "`dtype` must be one of"),
        ({"mode": "forward", "chip": "tpu9"}, "`chip` must be one of"),
    ],
)
def test_bad_options_are_named(options, message):
    arguments = {"chip": "cpu", **options}
    with pytest.raises(ValueError, match=message):
        compare_programs("linear", num_members=2, batch=2, width=4, **arguments)


# --- what the listing of extra kernels counts ----------------------------------


def _kernel(category, ops, hbm_bytes=1024, trips=1):
    return Kernel(
        f"{category}.{len(ops)}", category, tuple(sorted(ops)), 0, hbm_bytes,
        trips, None, None,
    )  # fmt: skip


def _cost(*kernels):
    return ProgramCost("v5e", Program(kernels, ()), temp_bytes=0, compile_seconds=0.0)


def test_the_extra_kernels_are_as_many_as_the_table_says():
    """As a v5e's train step had them: DMAs, which the kernels column does
    not count, and a BatchEnsemble matmul its compiler wrote as a
    convolution where the plain model's is a matmul. The listing counts what
    the table counts: 5 / 3 kernels, 2 more, and says the DMAs apart."""
    plain = _cost(
        _kernel("gemm", ["convolution", "add"]),
        _kernel("gemm", ["convolution", "maximum"]),
        _kernel("other", ["add"], trips=1),
        *[_kernel("dma", ["copy-start"])] * 3,
    )
    ensemble = _cost(
        _kernel("gemm", ["convolution", "add", "multiply"]),
        _kernel("conv", ["convolution", "maximum", "multiply"]),
        _kernel("other", ["add"]),
        _kernel("other", ["multiply", "reduce"], trips=2),
        *[_kernel("dma", ["copy-start"])] * 7,
    )
    row = Comparison("mlp", "train", "float32", 4, 128, ensemble, plain)
    extra = row.extra_kernels()
    assert ensemble.launches - plain.launches == 2
    assert sum(k.trips for k in extra) == 2
    assert {k.category for k in extra} == {"other"}
    assert [k["trips"] for k in row.as_dict()["extra_kernels"]] == [2]
    text = format_comparisons([row])
    assert "5 / 3" in text
    assert "v5e mlp train float32 E=4 (2 kernels): 2 x " in text
    assert "DMAs (no kernels: not in the table's counts): 7 / 3" in text
    # A plain kernel of a family the BatchEnsemble lacks still takes one of
    # its kernels: the listing never counts more than the difference.
    fewer = Comparison("m", "forward", "float32", 2, 2, _cost(_kernel("other", [])),
                       _cost(_kernel("gemm", ["dot"])))  # fmt: skip
    assert fewer.extra_kernels() == []


def test_the_table_says_which_side_is_the_batchensemble():
    row = Comparison(
        "mlp", "forward", "float32", 4, 128,
        _cost(_kernel("gemm", ["dot"]), _kernel("other", ["add"])),
        _cost(_kernel("gemm", ["dot"])),
    )  # fmt: skip
    for markdown in (False, True):
        text = format_comparisons([row], markdown=markdown)
        table_end = text.index("Kernels the BatchEnsemble adds")
        assert (
            "a / b: the BatchEnsemble's / the plain model's (one model on the "
            "same E*B rows); flops x and bytes x: the BatchEnsemble's over the "
            "plain model's" in text[:table_end]
        ), text


# --- a user's model, checked before anything is compiled ------------------------


def returns_a_number(rngs):
    """A factory that forgot to return its model."""
    return 42


def holds_nothing_to_convert(rngs):
    return nnx.Sequential(nnx.LayerNorm(8, rngs=rngs))


def takes_eight(rngs):
    """``[N, 8] -> [N, 3]``, with a LayerNorm the conversion leaves shared."""
    return nnx.Sequential(
        nnx.Linear(8, 16, rngs=rngs),
        nnx.LayerNorm(16, rngs=rngs),
        nnx.relu,
        nnx.Linear(16, 3, rngs=rngs),
    )


def breaks_in_its_factory(rngs):
    """A bug of the user's: its traceback must not be hidden."""
    return {}["missing"]


class _Broken(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        raise ZeroDivisionError("a bug in the model's forward")


def breaks_in_its_forward(rngs):
    return _Broken(rngs)


_FACTORY = "tests.test_compiled:"
_TINY = ["--members", "2", "--batch", "2", "--mode", "forward"]
_BENCHMARKS = {
    "compiled": ["--compiled-for", "cpu"],
    "timed": ["--repeats", "1", "--default-malloc"],
}


@pytest.fixture
def nothing_compiles(monkeypatch):
    """The checks come first: nothing is compiled or timed for a bad model."""

    def refuse(*args, **kwargs):
        raise AssertionError("compiled before the model was checked")

    from ensembles.benchmark.cost import speed

    monkeypatch.setattr(chips, "compile_for", refuse)
    monkeypatch.setattr(speed, "prepare_method", refuse)


@pytest.mark.parametrize("bench", sorted(_BENCHMARKS))
@pytest.mark.parametrize(
    "factory, shape, message",
    [
        (
            "returns_a_number",
            "8",
            "the factory returned int, not an nnx.Module: return the model",
        ),
        ("holds_nothing_to_convert", "8", "found no layer to convert"),
        (
            "takes_eight",
            "5",
            "the model does not take inputs of shape (N, 5) (TypeError: "
            "dot_general requires contracting dimensions to have the same "
            "shape, got (5,) and (8,).): give `input_shape` (--input-shape) one "
            "example's shape as the model takes it, without the batch axis",
        ),
        ("takes_eight", "8,2", "does not take inputs of shape (N, 8, 2)"),
    ],
)
def test_a_users_model_that_cannot_run_is_a_one_line_error(
    bench, factory, shape, message, nothing_compiles, capsys
):
    argv = [*_BENCHMARKS[bench], "--model", _FACTORY + factory,
            "--input-shape", shape, *_TINY]  # fmt: skip
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    prefix = f"ensembles-bench: error: --model {_FACTORY}{factory} --input-shape "
    assert lines[0].startswith(prefix + shape + ": "), lines[0]
    assert message in lines[0]
    assert captured.out == ""  # refused before the header


@pytest.mark.parametrize("bench", sorted(_BENCHMARKS))
@pytest.mark.parametrize(
    "factory, error",
    [("breaks_in_its_factory", KeyError), ("breaks_in_its_forward", ZeroDivisionError)],
)
def test_a_bug_in_a_users_model_keeps_its_traceback(
    bench, factory, error, nothing_compiles
):
    argv = [*_BENCHMARKS[bench], "--model", _FACTORY + factory,
            "--input-shape", "8", *_TINY]  # fmt: skip
    with pytest.raises(error):
        cli.main(argv)


@pytest.mark.parametrize("bench", sorted(_BENCHMARKS))
def test_the_command_names_the_layers_a_users_model_shares(bench, capsys):
    argv = [*_BENCHMARKS[bench], "--model", _FACTORY + "takes_eight",
            "--input-shape", "8", *_TINY]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    shared = (
        "takes_eight: left shared by every member (one copy, not converted): "
        "layers/1 (LayerNorm, 32 parameters)"
    )
    assert out[1] == shared, out  # under the header, above the tables
    assert not any("linear" in line and "left shared" in line for line in out)


def test_the_check_of_a_users_model_returns_what_stayed_shared():
    from ensembles.benchmark import check_convertible

    info = check_convertible(takes_eight, input_shape=(8,))
    assert info.shared_norms == (("layers/1", "LayerNorm", 32),)
    assert info.shared == ()
    assert check_convertible("mlp").shared_norms == ()
    with pytest.raises(ValueError, match=r"`input_shape` must give one example"):
        check_convertible(takes_eight)
