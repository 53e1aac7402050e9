"""Every docs page runs as written: its ``python`` blocks, in order, as a user
would paste them, each page in a fresh process.

Each runs as on a machine with one device, whatever XLA_FLAGS the tests run
under: ``scaling_out.md`` builds meshes of 8 devices, and its own code must
set them up. A page whose snippets end with values worth checking is run (in
process) and checked by its own module's tests instead (``test_rank1``,
``test_uncertainty_metrics``), not run twice.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
WITH_CODE = sorted(
    page.name
    for page in DOCS.glob("*.md")
    if re.search(r"```python\n", page.read_text())
)
RUN_ELSEWHERE = {
    "rank1.md": "tests/test_rank1.py",
    "uncertainty.md": "tests/test_uncertainty_metrics.py",
}
PAGES = [name for name in WITH_CODE if name not in RUN_ELSEWHERE]


def page_code(name):
    return "\n".join(
        re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), re.S)
    )


def test_every_page_with_code_is_run():
    assert {"converting.md", "training.md", "getting_started.md"} <= set(PAGES)
    for name, module in RUN_ELSEWHERE.items():
        assert name in WITH_CODE
        assert f'"docs" / "{name}"' in (ROOT / module).read_text(), module


@pytest.mark.slow  # every page in a fresh Python, end to end
@pytest.mark.parametrize("name", PAGES)
def test_the_page_runs_as_written(name, tmp_path):
    pytest.importorskip("optax")
    script = tmp_path / f"{name}.py"
    script.write_text(page_code(name))
    # A reader's fresh process on a machine with one device.
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    )
    env.pop("JAX_NUM_CPU_DEVICES", None)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
