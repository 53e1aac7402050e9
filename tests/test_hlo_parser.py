"""The compiled-program parser on the chips' own programs, saved.

Each fixture under ``tests/data/hlo/`` is an optimized program a chip's
compiler wrote in a deviceless compile, cut down to what a test is about
(``tests/data/hlo/make_fixtures.py`` says how each was made and writes them
again). The expected flops and bytes are worked out here by hand from the
shapes; the figures the parser gave before it read each case right are in
the comments. No chip's compiler is needed: the quick tier runs these.
"""

import pathlib

from ensembles.benchmark.cost.compiled.hlo import Program, parse_program
from ensembles.benchmark.cost.compiled.hlo_text import source_table
from ensembles.benchmark.cost.compiled.programs import Comparison, ProgramCost
from ensembles.benchmark.cost.compiled.report import format_comparisons

DATA = pathlib.Path(__file__).parent / "data" / "hlo"
F32 = 4


def kernels(fixture: str) -> dict:
    program = parse_program((DATA / fixture).read_text())
    return {kernel.name: kernel for kernel in program.kernels}


def program(fixture: str) -> Program:
    return parse_program((DATA / fixture).read_text())


# --- cuDNN's backward convolutions ---------------------------------------------


def conv_flops(batch, out_features, in_features, taps):
    """2 * batch * out * in * (output position, window tap) pairs on real input."""
    return 2 * batch * out_features * in_features * taps


# The plain CNN's three convolutions (256 rows of 32x32 RGB), as the H100's
# program has them: 3x3 SAME on 32x32 (pad 1: per axis 32 outputs x 3 taps,
# 2 of them on padding: 94 real), then two stride-2 convs on inputs the
# program pads itself (33x33 and 17x17: every tap real, 16 x 3 and 8 x 3).
CONV1 = conv_flops(256, 16, 3, 94 * 94)  # 217,153,536
CONV2 = conv_flops(256, 32, 16, (16 * 3) ** 2)  # 603,979,776
CONV3 = conv_flops(256, 32, 32, (8 * 3) ** 2)  # 301,989,888


def test_cudnn_backward_convolutions_cost_the_forward_they_differentiate():
    """A backward-filter call takes (input, output gradient) and returns the
    kernel's gradient; a backward-input call takes (output gradient, kernel)
    and returns the input's; both carry the forward's ``dim_labels`` and
    window, and each costs the forward convolution's flops."""
    found = kernels("h100_cnn_train_convolutions.hlo")
    expected = {
        "cudnn-conv-bias-activation.11": CONV1,
        "cudnn-conv-bias-activation.12": CONV2,
        "cudnn-conv-bias-activation.13": CONV3,
        # The first layer's kernel gradient, [16, 3, 3, 3] (o01i): read with
        # the forward's labels over the call's own operands it was 98,304.
        "cudnn-conv-bw-filter.5": CONV1,
        "cudnn-conv-bw-filter.6": CONV2,  # was 2,654,208
        "cudnn-conv-bw-filter.7": CONV3,  # was 5,308,416
        "cudnn-conv-bw-input.5": CONV2,  # was 69,337,088, and a "gemm"
        "cudnn-conv-bw-input.4": CONV3,  # was 63,438,848, and a "gemm"
    }
    assert {name: k.flops for name, k in found.items()} == expected
    assert {k.category for k in found.values()} == {"conv"}
    # The whole train step (these and the head's three 2*256*32*10 GEMMs):
    # 3.153 GFLOP, where the parser read 1.264.
    assert sum(expected.values()) + 3 * 2 * 256 * 32 * 10 == 3_152_707_584


# --- bytes a fusion reads through gathers and slices ---------------------------


def test_the_loss_reads_each_row_s_logit_at_its_label():
    """Softmax cross-entropy's fusion gathers one logit a row of the
    [1024, 1024] logits (take_along_axis); it reads 1024 of them, not 4 MB."""
    (loss,) = kernels("h100_dense_train_loss_plain.hlo").values()
    rows = 1024
    assert loss.hbm_bytes == (
        rows * F32  # the logsumexp's sums
        + rows * F32  # the gathered logits
        + rows * 4  # the labels (s32), read whole: the gather's indices
        + rows * F32  # the maxima
        + rows * F32  # the loss a row, written
    )  # was 4,210,688: the logits whole


def test_a_gather_after_elementwise_work_reads_what_it_gathers():
    """The BatchEnsemble's loss computes ``y * s + b`` of the [4, 256, 1024]
    product inside the loss fusion and gathers from that: only the gathered
    elements are computed, so 1024 of the product are read; ``s`` and ``b``
    ([4, 1024], broadcast) are counted whole."""
    (loss,) = kernels("h100_dense_train_loss_batchensemble.hlo").values()
    assert loss.hbm_bytes == (
        1024 * F32  # the sums
        + 4 * 1024 * F32  # b
        + 1024 * F32  # the gathered products
        + 4 * 1024 * F32  # s
        + 1024 * 4  # the labels
        + 4 * 256 * F32  # the maxima
        + 1024 * F32  # written
    )  # was 4,243,456


def test_three_fusions_slicing_one_gemm_read_a_third_each():
    """XLA merges the q, k, v projections of Flax's attention into one GEMM
    (split along k: [4, 128, 192] partials); each of three fusions reduces
    the partials and slices its 64 columns: it computes only those."""
    found = kernels("h100_attention_qkv.hlo")
    readers = [
        "loop_add_fusion",
        "input_transpose_fusion.1",
        "input_transpose_fusion.2",
    ]
    for name in readers:
        assert found[name].hbm_bytes == (
            4 * 128 * 64 * F32  # a third of the partials
            + 4 * 16 * F32  # the projection's bias
            + 8 * 4 * 16 * 16 * F32  # [B, heads, T, head] written
        ), name  # was 426,240 each: the partials whole, three times
    gemm = found["gemm_fusion_dot.10"]
    assert gemm.flops == 2 * 128 * 192 * 64
    assert gemm.hbm_bytes == (128 * 64 + 3 * 64 * 64 + 4 * 128 * 192) * F32


def test_slices_add_up_and_a_whole_use_counts_once():
    """Two slices of one operand read both slices; the same operand used
    whole as well is read once, whole; a gather reads what it gathers of its
    operand but its indices whole."""
    text = "\n".join(
        [
            "HloModule m",
            "%halves (p: f32[100,8]) -> f32[50,8] {",
            "  %p = f32[100,8]{1,0} parameter(0)",
            "  %a = f32[50,8]{1,0} slice(%p), slice={[0:50], [0:8]}",
            "  %b = f32[10,8]{1,0} slice(%p), slice={[60:70], [0:8]}",
            "  %bb = f32[50,8]{1,0} pad(%b, %z), padding=0_40x0_0",
            "  %z = f32[] constant(0)",
            "  ROOT %s = f32[50,8]{1,0} add(%a, %bb)",
            "}",
            "%both (p: f32[100,8]) -> f32[100,8] {",
            "  %p = f32[100,8]{1,0} parameter(0)",
            "  %a = f32[50,8]{1,0} slice(%p), slice={[0:50], [0:8]}",
            "  %w = f32[100,8]{1,0} negate(%p)",
            "  %c = f32[100,8]{1,0} concatenate(%a, %a), dimensions={0}",
            "  ROOT %s = f32[100,8]{1,0} add(%w, %c)",
            "}",
            "%pick (t: f32[100,8], i: s32[6,1]) -> f32[6,8] {",
            "  %t = f32[100,8]{1,0} parameter(0)",
            "  %i = s32[6,1]{1,0} parameter(1)",
            "  ROOT %g = f32[6,8]{1,0} gather(%t, %i), offset_dims={1}, "
            "collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, "
            "slice_sizes={1,8}",
            "}",
            "ENTRY %main (x: f32[100,8], i: s32[6,1]) -> f32[50,8] {",
            "  %x = f32[100,8]{1,0} parameter(0)",
            "  %i = s32[6,1]{1,0} parameter(1)",
            "  %h = f32[50,8]{1,0} fusion(%x), kind=kLoop, calls=%halves",
            "  %w = f32[100,8]{1,0} fusion(%x), kind=kLoop, calls=%both",
            "  %g = f32[6,8]{1,0} fusion(%x, %i), kind=kLoop, calls=%pick",
            "  ROOT %lone = f32[20,8]{1,0} slice(%x), slice={[0:20], [0:8]}",
            "}",
        ]
    )
    found = {k.name: k.hbm_bytes for k in parse_program(text).kernels}
    assert found == {
        "h": (50 + 10) * 8 * F32 + 50 * 8 * F32,
        "w": 100 * 8 * F32 + 100 * 8 * F32,
        "g": 6 * 8 * F32 + 6 * 4 + 6 * 8 * F32,
        "lone": 20 * 8 * F32 + 20 * 8 * F32,
    }


# --- collectives, and a combined all-reduce's buffer ---------------------------


def test_collectives_and_the_bytes_they_carry_on_eight_h100s():
    """A shard_map of every collective, 8 H100s: each is a ``collective``
    with the bytes it carries (an all-gather its gathered array, a
    reduce-scatter its input); no ``-done`` is a kernel."""
    found = kernels("h100x8_collectives.hlo")
    rows = 64 * 128 * F32  # y, [64, 128] a device
    carried = {
        "all-gather-start": 1024 * 128 * F32,  # w gathered: [8 * 128, 128]
        "all-reduce-start": 129 * F32,  # psum(sum(y, 0)) and psum(sum(x)), combined
        "reduce-scatter-start": rows,  # its input
        "all-to-all-start": rows,
        "collective-permute-start": rows,
    }
    collectives = {n: k for n, k in found.items() if k.category == "collective"}
    assert {n: k.collective_bytes for n, k in collectives.items()} == carried
    # Each reads its operands and writes its results once (an all-gather's
    # printed shape is (operand, result): the operand is not written).
    assert found["all-gather-start"].hbm_bytes == 128 * 128 * F32 + 1024 * 128 * F32
    assert found["reduce-scatter-start"].hbm_bytes == rows + 8 * 128 * F32
    whole = program("h100x8_collectives.hlo")
    assert whole.collectives == 5
    assert whole.collective_bytes == sum(carried.values())
    assert not any(name.endswith("-done") for name in found)
    assert whole.launches == 13  # was 15: reduce-scatter-done, all-to-all-done


def test_each_slice_of_a_combined_all_reduce_reads_its_part():
    """The two psums are combined into one all-reduce of a [129] buffer
    (``wrapped_concatenate``); a ``wrapped_slice`` takes each result out of
    it: together they read the buffer once (each read it whole: twice)."""
    found = kernels("h100x8_collectives.hlo")
    assert found["wrapped_slice.1"].hbm_bytes == 128 * F32 * 2  # was 1028
    assert found["wrapped_slice.2"].hbm_bytes == 1 * F32 * 2  # was 520
    # The all-gathered weights, of which the matmul takes the first 128 rows.
    assert found["wrapped_slice"].hbm_bytes == 128 * 128 * F32 * 2  # was 589,824


def test_a_tpu_s_collectives_in_on_chip_memory():
    """On a v5e 2x2 the collectives are synchronous (a collective-permute
    asynchronous, with two u32 contexts), their buffers mostly in on-chip
    memory (S(1): no main-memory bytes), but they carry what they carry;
    psum_scatter becomes part of one combined all-reduce."""
    found = kernels("v5e2x2_collectives.hlo")
    rows = 64 * 128 * F32
    carried = {
        "all-gather.4": 4 * 128 * 128 * 2,  # w gathered, as bfloat16
        "collective-permute-start": rows,
        "all_to_all.9": rows,
        "all-reduce.1": 128 * F32 + rows + F32,  # sum(y, 0), y, sum(x)
    }
    assert {
        n: k.collective_bytes for n, k in found.items() if k.category == "collective"
    } == carried
    assert found["all-gather.4"].hbm_bytes == 0
    # Of the all-reduce's, sum(x) in and sum(y, 0) and sum(x) out are in HBM.
    assert found["all-reduce.1"].hbm_bytes == F32 + 128 * F32 + F32
    assert program("v5e2x2_collectives.hlo").collectives == 4


def test_the_report_says_collectives_where_a_program_has_them():
    def cost(program):
        return ProgramCost("h100", program, temp_bytes=0, compile_seconds=0.0)

    sharded = cost(program("h100x8_collectives.hlo"))
    one = cost(program("h100_block_callers.hlo"))
    row = Comparison("step", "train", "float32", 8, 8, sharded, sharded)
    assert "collectives (MB)" in format_comparisons([row])
    assert "5 (0.62) / 5 (0.62)" in format_comparisons([row])
    alone = Comparison("block", "forward", "float32", 2, 8, one, one)
    assert "collectives" not in format_comparisons([alone])


# --- each kernel's layer --------------------------------------------------------


def test_each_kernel_names_the_model_line_that_called_its_layer():
    """A converted block's query, key and up projections all run
    ``ops/dense_batched.py``'s one matmul line; their callers are the
    block's three lines."""
    found = kernels("h100_block_callers.hlo")
    gemms = {n: k for n, k in found.items() if k.category == "gemm"}
    assert len({k.source for k in gemms.values()}) == 1
    assert "ensembles/ops/" in next(iter(gemms.values())).source
    callers = {n: k.caller.rsplit("/", 1)[-1] for n, k in gemms.items()}
    assert callers == {
        "gemm_fusion_dot_general.3": "make_fixtures.py:52 (Block.__call__)",  # query
        "gemm_fusion_dot_general.4": "make_fixtures.py:53 (Block.__call__)",  # key
        "gemm_fusion_dot_general.5": "make_fixtures.py:54 (Block.__call__)",  # up
    }
    # The model's own elementwise work is its own caller.
    multiply = found["wrapped_multiply"]
    assert multiply.caller == multiply.source


def test_the_report_lists_extra_kernels_by_their_model_line():
    block = program("h100_block_callers.hlo")

    def cost(program):
        return ProgramCost("h100", program, temp_bytes=0, compile_seconds=0.0)

    row = Comparison(
        "block", "forward", "float32", 2, 8, cost(block), cost(Program((), ()))
    )
    text = format_comparisons([row], limit=8)
    for line in (52, 53, 54):
        assert f"at make_fixtures.py:{line} (Block.__call__) via ensembles/ops/" in text
    callers = {k["caller"] for k in row.as_dict()["extra_kernels"] if k["caller"]}
    assert {c.rsplit(":", 1)[0].rsplit("/", 1)[-1] for c in callers} == {
        "make_fixtures.py"
    }


def test_stack_frames_printed_either_way():
    """XLA 0.10-0.12 prints a frame's parent one above its id (a root names
    itself); a table printed plainly (0 for none) reads the same."""
    names = "\n".join(
        [
            "FileNames",
            '1 "/u/model.py"',
            '2 "/x/site-packages/flax/nnx/helpers.py"',
            '3 "/x/src/ensembles/ops/dense.py"',
            "",
            "FunctionNames",
            '1 "Model.__call__"',
            '2 "Sequential.__call__"',
            '3 "dense"',
            "",
            "FileLocations",
            "1 {file_name_id=1 function_name_id=1 line=7}",
            "2 {file_name_id=2 function_name_id=2 line=289}",
            "3 {file_name_id=3 function_name_id=3 line=42}",
            "",
            "StackFrames",
        ]
    )
    shifted = (
        names
        + "\n1 {file_location_id=1 parent_frame_id=1}\n"
        + (
            "2 {file_location_id=2 parent_frame_id=2}\n"
            "3 {file_location_id=3 parent_frame_id=3}\n"
        )
    )
    plain = (
        names
        + "\n1 {file_location_id=1 parent_frame_id=0}\n"
        + (
            "2 {file_location_id=2 parent_frame_id=1}\n"
            "3 {file_location_id=3 parent_frame_id=2}\n"
        )
    )
    for tables in (shifted, plain):
        frames = source_table(tables)
        assert [frames[k].parent for k in (1, 2, 3)] == [0, 1, 2]
        text = "\n".join(
            [
                "HloModule m",
                tables,
                "ENTRY %main (x: f32[4]) -> f32[4] {",
                "  %x = f32[4]{0} parameter(0)",
                "  ROOT %n = f32[4]{0} negate(%x), metadata={stack_frame_id=3}",
                "}",
            ]
        )
        (kernel,) = parse_program(text).kernels
        assert kernel.source == "ensembles/ops/dense.py:42 (dense)"
        assert kernel.caller == "/u/model.py:7 (Model.__call__)"
