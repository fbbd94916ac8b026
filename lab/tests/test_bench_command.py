"""``vlkv bench <program>``: each benchmark is a subcommand with its own flags and the shared ones."""

from __future__ import annotations

import pytest
from vlkv.deploy.cli.main import main
from vlkv_lab.bench.command import PROGRAMS


def _exit(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out + out.err


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_every_program_has_its_own_help_with_the_shared_flags(name, capsys):
    code, text = _exit(["bench", name, "--help"], capsys)
    assert code == 0
    program = PROGRAMS[name]
    assert ("--quick" in text) == program.quick
    assert ("--out" in text) == (program.out is not None)
    if program.out is not None:
        assert program.out in text  # its own default folder, not a shared one


def test_a_program_refuses_another_programs_flag(capsys):
    code, text = _exit(["bench", "capacity", "--verify-n", "3"], capsys)
    assert code == 2 and "--verify-n" in text
    code, text = _exit(["bench", "verify-cost", "--quick"], capsys)  # it has no reduced size
    assert code == 2 and "--quick" in text


def test_bench_without_a_program_names_them(capsys):
    code, text = _exit(["bench"], capsys)
    assert code == 2 and "program" in text
