"""The lab's commands (``eval``, ``bench``, ``simulate``, ``profile``) on
the ``vlkv`` command line.

The lab (``vlkv_lab``, ``lab/`` in the repo) is a distribution of its own that the product never imports: its
command module is looked up by name, only when one of its commands (or ``vlkv --help``) is asked for. Without
it those commands exit 2 with a line saying how to install it."""

from __future__ import annotations

import importlib
import importlib.util
import sys

COMMANDS = ("eval", "bench", "simulate", "profile")
INSTALL = "pip install -e lab"


def load():
    """The lab's command module (``vlkv_lab.cli``), or None when the lab is not installed. A lab that is
    installed but fails to import (a dependency of its own missing) raises."""
    if importlib.util.find_spec("vlkv_lab") is None:
        return None
    return importlib.import_module("vlkv_lab.cli")


def add_parsers(sub, lab, names) -> None:
    """Add each lab command of ``names``: the lab's own subparser, or without the lab a stand-in for
    ``--help``."""
    for name in names:
        if lab is not None:
            lab.PARSERS[name](sub)
        else:
            sub.add_parser(name, help=f"(a lab command; the lab is not installed: {INSTALL} from the repo)")


def extra_commands(lab) -> list[str]:
    """Lab commands the product does not list yet (they go at the end of ``vlkv --help``)."""
    return [] if lab is None else [name for name in lab.PARSERS if name not in COMMANDS]


def not_installed(command: str) -> int:
    print(
        f"vlkv {command}: a lab command, and the lab (vlkv-lab) is not installed; from the repo: {INSTALL}",
        file=sys.stderr,
    )
    return 2
