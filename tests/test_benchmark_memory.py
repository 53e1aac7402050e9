"""The benchmark's allocator setting and page-fault counts (``docs/cost.md``)."""

import json
import mmap
import os
import platform
import subprocess
import sys

import pytest

from ensembles.benchmark import (
    cli,
    main,
    page_faults_per_call,
    reuse_freed_memory,
    run_benchmark,
)
from ensembles.benchmark.cost import report
from ensembles.benchmark.cost import timing as timing_module

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A jitted program with a 64 MiB temporary (sin(x), the matmul's operand),
# timed 15 rounds after 5 warm-up calls in a fresh process that first reuses
# freed memory (argv[1] == "reuse") or not; the median faults of a call.
_SCRIPT = """
import statistics, sys
from ensembles.benchmark import interleaved_times, reuse_freed_memory
reused = reuse_freed_memory() if sys.argv[1] == "reuse" else None
import jax, jax.numpy as jnp
x, w = jnp.ones((8192, 2048)), jnp.ones((2048, 8))
f = jax.jit(lambda x, w: jnp.sin(x) @ w)
temp = f.lower(x, w).compile().memory_analysis().temp_size_in_bytes
faults = {}
interleaved_times({"f": lambda: f(x, w)}, 15, warmup=5, page_faults=faults)
print(reused, temp, statistics.median(faults["f"]))
"""


def _faults_in_a_fresh_process(mode):
    env = {  # glibc's own settings from the environment would decide the test
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
    }
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env=env,
    )
    reused, temp, faults = done.stdout.split()
    return reused, int(temp), float(faults)


@pytest.mark.slow  # two fresh processes
@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's; elsewhere it is off")
def test_reused_memory_stops_the_page_faults_of_every_step():
    # A fault a page (a huge page where the kernel backs every mapping so).
    page = 2**21 if "[always]" in _transparent_huge_pages() else mmap.PAGESIZE
    reused, temp, faults = _faults_in_a_fresh_process("default")
    assert reused == "None" and temp >= 64 * 2**20
    # By default glibc maps the temporary afresh on every call.
    assert faults >= 0.9 * temp / page
    reused, temp, faults = _faults_in_a_fresh_process("reuse")
    assert reused == "True" and temp >= 64 * 2**20
    assert faults < 0.02 * temp / page


def _transparent_huge_pages():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as settings:
            return settings.read()
    except OSError:
        return ""


@pytest.mark.skipif(not GLIBC, reason="elsewhere it sets nothing, and says nothing")
def test_reuse_freed_memory_called_after_jax_started_says_so():
    import jax.numpy as jnp

    jnp.ones(1).block_until_ready()  # JAX has started (conftest sets nothing)
    with pytest.warns(UserWarning, match="called after JAX started") as caught:
        reuse_freed_memory()
    assert "MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0" in str(caught[0].message)


def test_reuse_freed_memory_is_off_where_the_c_library_is_not_glibc(monkeypatch):
    monkeypatch.setattr(timing_module.platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(
        timing_module.ctypes, "CDLL", lambda *a: pytest.fail("malloc was changed")
    )
    assert reuse_freed_memory() is False


@pytest.mark.skipif(sys.platform == "win32", reason="Windows counts no page faults")
def test_page_faults_per_call_counts_fresh_memory():
    import numpy as np

    pages = 4096

    def touch_fresh_pages():  # a new mapping: its first touch of a page faults
        with mmap.mmap(-1, pages * mmap.PAGESIZE) as fresh:
            np.frombuffer(fresh, dtype=np.uint8)[:: mmap.PAGESIZE] = 1

    assert page_faults_per_call(touch_fresh_pages, calls=3) >= pages
    assert page_faults_per_call(lambda: np.zeros(1), calls=3) < pages / 16


def _rows(faults):
    rows = run_benchmark(
        models=["linear"], modes=["forward"], members=[2], batch=2, width=4, repeats=2
    )
    for row in rows:
        assert row["page_faults_per_step"] is None or row["page_faults_per_step"] >= 0
        row["page_faults_per_step"] = faults.get(row["method"], 0.0)
        row["q1_s"] = row["q3_s"] = row["median_s"]  # no spread note
    return rows


def test_a_rows_page_faults_are_the_median_of_its_timed_calls(monkeypatch):
    from ensembles.benchmark.cost import speed

    counted = {}

    def timed(fns, repeats, page_faults=None):
        for index, name in enumerate(fns):  # method k: faults k, 10k, 100k, ...
            counted[name] = [index * 10**round_ for round_ in range(repeats)]
        page_faults.update(counted)
        return {name: [1e-3] * repeats for name in fns}

    monkeypatch.setattr(speed, "interleaved_times", timed)
    rows = run_benchmark(
        models=["linear"], modes=["forward"], members=[2], batch=2, width=4, repeats=3
    )
    for row in rows:
        assert row["page_faults_per_step"] == sorted(counted[row["method"]])[1]


def test_the_table_names_the_steps_that_page_faulted():
    rows = _rows({"batchensemble": 24_671.5, "single": 999.0})
    for text, gap in (
        (report.format_table(rows), "\n"),
        (report.format_markdown(rows), "\n\n"),
    ):
        note = text.split("|")[-1] if gap == "\n\n" else text.splitlines()[-1]
        assert "Page faults per step: batchensemble (E=2) 24,672." in note
        assert "single" not in note  # under FAULTS_NOTED
        assert gap + "Page faults per step" in text  # Markdown: its own paragraph
    quiet = _rows({})
    assert "Page faults" not in report.format_table(quiet)
    assert "Page faults" not in report.format_markdown(quiet)


@pytest.mark.parametrize("argv, reused", [([], True), (["--default-malloc"], False)])
def test_the_command_reuses_freed_memory_unless_asked_not_to(
    capsys, monkeypatch, tmp_path, argv, reused
):
    calls = []

    def record(name, fn):
        return lambda *a, **k: calls.append(name) or fn(*a, **k)

    monkeypatch.setattr(cli, "reuse_freed_memory", record("reuse", lambda: True))
    for name in ("check_models", "describe_device"):
        monkeypatch.setattr(cli, name, record(name, getattr(cli, name)))
    tiny = ["--model", "linear", "--mode", "forward", "--members", "2", "--batch", "2"]
    path = tmp_path / "bench.json"
    assert (
        main([*tiny, "--width", "4", "--repeats", "1", "--json", str(path), *argv]) == 0
    )
    header = capsys.readouterr().out.splitlines()[0]
    # Set before JAX runs anything: the model check and the device query do.
    assert calls == ["reuse"] * reused + ["check_models", "describe_device"]
    assert header.endswith(
        "malloc keeps freed memory" if reused else "the default malloc"
    )
    assert cli._parse(argv).default_malloc is (not reused)
    config = json.loads(path.read_text())["config"]
    assert config["malloc_keeps_freed_memory"] is reused


def test_default_malloc_is_an_option_of_the_speed_benchmark(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["--quality", "--default-malloc"])
    assert raised.value.code == 2
    assert "--default-malloc applies only without --quality" in capsys.readouterr().err


def test_the_table_names_the_rows_whose_times_spread_widely():
    rows = _rows({"batchensemble": 24_671.5})
    single = next(row for row in rows if row["method"] == "single")
    median = single["median_s"]
    single["q1_s"], single["q3_s"] = 0.8 * median, 1.2 * median
    for text, gap in (
        (report.format_table(rows), "\n"),
        (report.format_markdown(rows), "\n\n"),
    ):
        expected = "Spread of ±10% or more over the rounds: single (E=2) ±20%."
        assert gap + expected in text
        assert "batchensemble (E=2) ±" not in text.split(expected)[1]
        # The page-fault note follows, a paragraph of its own in Markdown.
        assert gap + "Page faults per step: batchensemble" in text
    single["q1_s"], single["q3_s"] = 0.95 * median, 1.05 * median
    assert "Spread of" not in report.format_table(rows)  # ±5%: under SPREAD_NOTED
