"""Every command the README and docs/ show still exists with the flags they give it (issue 63): each ``vlkv ...``
line of a code block parses through the real command line (placeholders filled in), each inline ``vlkv ...``
mention names a command and flags it has, and each ``python -m MODULE`` shown answers ``--help``.

A renamed flag or command fails here, not in a newcomer's shell. Running them at reduced sizes is the job
of each command's own tests (and ``vlkv bench all --quick`` of the bench's)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from vlkv.deploy.cli import lab
from vlkv.deploy.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Words the docs use as placeholders, and a value of the right type for each.
PLACEHOLDERS = {
    "N": "4",
    "M": "default",
    "DIR": "some/dir",
    "PATH": "some/file",
    "NAME": "default",
    "SERVE": "4242",  # $SERVE: a pid
}
# Backquoted names that are not commands: a system's name in a table ("vlkv full") and a logged message.
NOT_COMMANDS = ("vlkv full", "vlkv calibrate: ")


def _blocks(text: str) -> list[str]:
    """Command lines of the fenced code blocks, continuation lines joined, comments cut."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].split(" & ")[0].strip().rstrip("&").strip()
            if line.startswith(("vlkv ", "python -m ")):
                lines.append(line)
    return lines


def _inline(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [c.strip() for c in re.findall(r"`([^`\n]+)`", prose) if c.startswith(("vlkv ", "python -m "))]


def _shown() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    blocks, inline = [], []
    for path in DOCS:
        text = path.read_text()
        blocks += [(path.name, c) for c in _blocks(text)]
        inline += [(path.name, c) for c in _inline(text) if not c.startswith(NOT_COMMANDS)]
    return blocks, inline


BLOCKS, INLINE = _shown()


def _argv(line: str) -> list[str]:
    """The words after ``vlkv``: optional parts ``[...]`` given, the first of ``a|b``, placeholders filled."""
    words = shlex.split(line.replace("$", "").replace("[", " ").replace("]", " "))[1:]
    return [PLACEHOLDERS.get(w.split("|")[0], w.split("|")[0]) for w in words]


@pytest.fixture(scope="module")
def parser():
    return build_parser(lab.load())


def _subparser(parser, argv: list[str]):
    """The parser of the command (and a bench or eval program) ``argv`` names, and the words after its name."""
    action = next(a for a in parser._actions if a.dest == "command")
    assert argv and argv[0] in action.choices, f"no command {argv[:1]}"
    sub, rest = action.choices[argv[0]], argv[1:]
    programs = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]  # bench's, eval's
    if programs and rest and not rest[0].startswith("-"):
        assert rest[0] in programs[0].choices, f"no {argv[0]} program {rest[0]!r}"
        sub, rest = programs[0].choices[rest[0]], rest[1:]
    return sub, rest


def test_the_docs_show_commands():
    assert len(BLOCKS) > 20 and len(INLINE) > 50  # the extraction finds what the docs hold


@pytest.mark.parametrize("where,line", [b for b in BLOCKS if b[1].startswith("vlkv ")])
def test_a_code_block_command_parses(parser, where, line):
    try:
        parser.parse_args(_argv(line))
    except SystemExit as exc:
        pytest.fail(f"{where}: `{line}` does not parse (exit {exc.code})")


@pytest.mark.parametrize("where,line", [i for i in INLINE if i[1].startswith("vlkv ")])
def test_an_inline_command_names_a_command_and_its_flags(parser, where, line):
    words = [w for w in re.split(r"[\s\[\]|]+", line) if w and not w.startswith("<")][
        1:
    ]  # <x>: a placeholder
    sub, rest = _subparser(parser, words)
    flags = {w.split("=")[0] for w in rest if w.startswith("--")}
    missing = sorted(f for f in flags if f not in sub._option_string_actions)
    assert not missing, f"{where}: `{line}`: no such flag {missing}"


MODULES = sorted({shlex.split(c)[2] for _, c in BLOCKS + INLINE if c.startswith("python -m ")})


@pytest.mark.parametrize("module", MODULES)
def test_a_module_the_docs_run_answers_help(module):
    run = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert run.returncode == 0, f"python -m {module} --help: {run.stderr[-2000:]}"
