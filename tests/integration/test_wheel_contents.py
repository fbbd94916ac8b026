"""The ``vlkv`` wheel holds the product alone (issue 63): the serving packages and the ``vlkv`` command line
(``vlkv.deploy.cli``), no lab (``vlkv_lab``, the old ``vlkv/tools``) and no checkpoint but the embedded
default model that ``vlkv serve`` and ``vlkv demo`` run without ``--model``.

Builds the wheel the way a release would (``pip wheel . --no-deps --no-build-isolation``) from a copy of this
checkout, so a stale ``build/`` folder here can neither leak into it nor be written. Runs wherever setuptools
can build a wheel (the test extras hold setuptools); elsewhere it skips, saying why, except under CI
(``CI`` set, as ``.ci/run`` runs), where a venv that cannot build the wheel fails it.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = (
    "vlkv/v1",
    "vlkv/common",
    "vlkv/common/model",
    "vlkv/common/handoff",
    "vlkv/common/compression",
    "vlkv/common/default_model",
    "vlkv/kernels",
    "vlkv/prefill_worker",
    "vlkv/decode_worker",
    "vlkv/services",
    "vlkv/deploy",
    "vlkv/deploy/cli",
)
CLI = ("main", "flags", "verify_flags", "lab", "serve", "generate", "demo", "status", "kernels")
CHECKPOINTS = (".safetensors", ".bin", ".gguf")
# The product's one checkpoint: the embedded default model (common/config.py DEFAULT_MODEL_DIR).
DEFAULT_MODEL = "vlkv/common/default_model/model.safetensors"
NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "out", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
)


def _why_not_buildable() -> str:
    """Why this interpreter cannot build the wheel without build isolation ("" when it can)."""
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed"
    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return (
            f"setuptools {setuptools.__version__} builds wheels only with the `wheel` package, not installed"
        )
    return ""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    if why := _why_not_buildable():
        if os.environ.get("CI"):
            pytest.fail(f"CI cannot build the vlkv wheel: {why} (the test extras install setuptools)")
        pytest.skip(f"cannot build the vlkv wheel here: {why}")
    tree = tmp_path_factory.mktemp("tree") / "vlkv"
    shutil.copytree(ROOT, tree, ignore=NOT_COPIED, symlinks=True)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        ".",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
    ]
    run = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    (path,) = out.glob("vlkv-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_the_wheel_holds_no_lab_and_no_lab_checkpoint(wheel):
    names = wheel.namelist()
    assert not [n for n in names if n.startswith(("vlkv_lab/", "vlkv/tools/")) or "/zoo/" in n]
    checkpoints = [n for n in names if n.endswith(CHECKPOINTS)]
    assert checkpoints == [DEFAULT_MODEL], checkpoints


def test_the_wheel_holds_the_product_packages_and_its_command_line(wheel):
    names = set(wheel.namelist())
    for package in PRODUCT:
        assert f"{package}/__init__.py" in names or any(n.startswith(package + "/") for n in names), package
    for module in CLI:
        assert f"vlkv/deploy/cli/{module}.py" in names, module
    assert {
        "vlkv/deploy/client.py",
        "vlkv/deploy/synthetic_task.py",
        "vlkv/deploy/kernel_compile.py",
        "vlkv/deploy/pool.py",
        "vlkv/deploy/progress.py",
    } <= names
    # Calibration writes the profiles ``vlkv serve`` loads: it ships with the product.
    for module in ("command", "measure", "prepared", "prompts", "answers", "jobs", "verifier", "reuse"):
        assert f"vlkv/deploy/calibrate/{module}.py" in names, module
    tops = {n.split("/")[0] for n in names}
    assert tops == {"vlkv", next(t for t in tops if t.endswith(".dist-info"))}, tops


def test_vlkv_is_the_wheels_console_script(wheel):
    (info,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel.read(info).decode())
    scripts = dict(entry_points["console_scripts"])
    assert scripts == {"vlkv": "vlkv.deploy.cli.main:main"}, scripts
