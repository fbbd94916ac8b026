"""The ``vlkv`` command line and the lab (issue 63): the product's commands never load ``vlkv_lab``; the lab's
run through ``vlkv`` with the same parsers as ``vlkv-lab``; without the lab they exit 2 saying how to
install it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from vlkv.deploy.cli import lab as cli_lab
from vlkv.deploy.cli.main import ORDER, PRODUCT, main
from vlkv_lab import cli as lab_cli

# Run in a fresh interpreter; HIDE_LAB first makes it one where the lab is not installed (its editable
# install's finder dropped, as decode_step.py's other-checkout workers do with every editable finder).
HIDE_LAB = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
    "if not getattr(f, '__module__', '').startswith('__editable___vlkv_lab')]\n"
)
RUN = (
    "import sys\nfrom vlkv.deploy.cli.main import main\n"
    "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
    "print('lab loaded:', 'vlkv_lab' in sys.modules)\nsys.exit(rc)\n"
)


def _vlkv(*argv: str, hide_lab: bool = False) -> subprocess.CompletedProcess:
    code = (HIDE_LAB if hide_lab else "") + RUN
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, check=False
    )


def _help(argv: list[str], capsys, entry=main) -> str:
    with pytest.raises(SystemExit) as exit_:
        entry(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_command_is_the_products_or_the_labs_and_listed_once():
    assert set(lab_cli.PARSERS) == set(cli_lab.COMMANDS)
    assert sorted(ORDER) == sorted([*PRODUCT, *cli_lab.COMMANDS])
    assert not set(PRODUCT) & set(cli_lab.COMMANDS)


@pytest.mark.parametrize("command", ["eval", "bench", "simulate", "profile"])
def test_a_lab_command_has_the_same_parser_in_vlkv_and_vlkv_lab(command, capsys):
    through_vlkv = _help([command, "--help"], capsys)
    own = _help([command, "--help"], capsys, entry=lab_cli.main)
    assert through_vlkv.split() == own.replace("vlkv-lab", "vlkv").split()


def test_a_product_command_never_loads_the_lab():
    run = _vlkv("serve", "--help")
    assert run.returncode == 0, run.stderr
    assert "--prefix-cache-mb" in run.stdout and "lab loaded: False" in run.stdout
    run = _vlkv("eval", "--help")  # a lab command does
    assert run.returncode == 0 and "lab loaded: True" in run.stdout, run.stderr


def test_without_the_lab_its_commands_exit_2_saying_how_to_install_it():
    run = _vlkv("eval", "--policy", "vlcache", hide_lab=True)
    assert run.returncode == 2, run.stdout + run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("vlkv eval: ") and "pip install -e lab" in line
    listed = _vlkv("--help", hide_lab=True)
    assert listed.returncode == 0, listed.stderr
    words = " ".join(listed.stdout.split())  # argparse wraps the help lines
    assert all(name in words for name in ORDER) and "pip install -e lab" in words
    served = _vlkv("status", "--help", hide_lab=True)
    assert served.returncode == 0 and "--events" in served.stdout, served.stderr
    calibrate = _vlkv("calibrate", "--help", hide_lab=True)  # calibration is the product's
    assert calibrate.returncode == 0 and "--prompts" in calibrate.stdout, calibrate.stderr
    assert "lab loaded: False" in calibrate.stdout
