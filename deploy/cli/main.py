"""The ``vlkv`` command line: the product's commands (serve, generate, demo, status, kernels, calibrate,
calibrate-reuse), each in a module of its own, and the lab's (eval, bench, simulate, profile) when the lab is
installed (``lab.py``)."""

from __future__ import annotations

import argparse
import logging
import sys

from vlkv.deploy.calibrate import command as calibrate
from vlkv.deploy.cli import demo, generate, kernels, lab, serve, status

PRODUCT = {
    "serve": serve.add_parser,
    "generate": generate.add_parser,
    "demo": demo.add_parser,
    "status": status.add_parser,
    "kernels": kernels.add_parser,
    "calibrate": calibrate.add_parser,
    "calibrate-reuse": calibrate.add_reuse_parser,
}
# The order ``vlkv --help`` lists the commands in.
ORDER = (
    "serve",
    "generate",
    "demo",
    "status",
    "eval",
    "bench",
    "kernels",
    "calibrate",
    "calibrate-reuse",
    "simulate",
    "profile",
)


def build_parser(lab_cli=None) -> argparse.ArgumentParser:
    """Every command's parser; the lab's from ``lab_cli`` (``vlkv_lab.cli``), stand-ins without it."""
    parser = argparse.ArgumentParser(
        prog="vlkv", description="Disaggregated VLM serving with compressed KV caches"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ORDER:
        if name in PRODUCT:
            PRODUCT[name](sub)
        else:
            lab.add_parsers(sub, lab_cli, [name])
    lab.add_parsers(sub, lab_cli, lab.extra_commands(lab_cli))
    return parser


def run(args: argparse.Namespace, prog: str = "vlkv") -> int:
    """Run a parsed command (its ``func``); a configuration error is one line and exit 2."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from vlkv.common.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    lab_cli = None
    # A lab command, a mistyped one or none (``vlkv --help``): the lab's parsers, where it is installed.
    if command not in PRODUCT:
        lab_cli = lab.load()
        if lab_cli is None and command in lab.COMMANDS:
            return lab.not_installed(command)
    return run(build_parser(lab_cli).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
