"""A source checkout's root never stays on sys.path: its top-level ``kernels/`` would shadow the ``kernels``
distribution that transformers >= 5.25 imports (vlkv.common.checkout)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vlkv.common.checkout import checkout_root

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_checkout_is_found_from_an_editable_install():
    assert checkout_root() == ROOT


def test_importing_the_deploy_package_drops_the_root_and_its_bare_names():
    # As a Ray worker of a driver started in the checkout sees it: the root first on its path.
    code = (
        f"import sys, importlib.util; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, '')\n"
        f"assert importlib.util.find_spec('kernels').origin == {str(ROOT / 'kernels' / '__init__.py')!r}\n"
        "import vlkv.deploy\n"
        f"assert {str(ROOT)!r} not in sys.path and '' not in sys.path, sys.path\n"
        "spec = importlib.util.find_spec('kernels')\n"
        f"assert spec is None or spec.origin != {str(ROOT / 'kernels' / '__init__.py')!r}, spec.origin\n"
        "from transformers import LlamaConfig\n"
        "print('ok')"
    )
    run = _run(code, ROOT)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


def test_the_lab_package_drops_it_too():
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "import vlkv_lab\n"
        f"assert {str(ROOT)!r} not in sys.path, sys.path\n"
        "print('ok')"
    )
    run = _run(code, ROOT)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


def test_other_entries_are_kept(tmp_path):
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); sys.path.insert(0, {str(ROOT)!r})\n"
        "import vlkv.deploy\n"
        f"assert sys.path[0] == {str(tmp_path)!r}, sys.path\n"
        "print('ok')"
    )
    run = _run(code, tmp_path)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
