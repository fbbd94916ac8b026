"""The lab's commands: ``vlkv-lab eval|bench|simulate|profile``, also run as
``vlkv <command>`` (the product's command line finds this module by name when the lab is installed,
``deploy/cli/lab.py``)."""

from __future__ import annotations

import argparse
import sys


def _add_eval(sub) -> None:
    from vlkv_lab.eval.command import add_eval_parser

    add_eval_parser(sub)


def _add_bench(sub) -> None:
    from vlkv_lab.bench.command import add_parser

    add_parser(sub)


def _add_simulate(sub) -> None:
    from vlkv_lab.sim import main as sim_main

    sim_main.add_parser(sub)


def _add_profile(sub) -> None:
    from vlkv_lab.sim import main as sim_main

    sim_main.add_profile_parser(sub)


# Each lab command and what adds its subparser (its flags and ``func``), in the order ``--help`` lists them.
PARSERS = {
    "eval": _add_eval,
    "bench": _add_bench,
    "simulate": _add_simulate,
    "profile": _add_profile,
}


def build_parser(prog: str = "vlkv-lab") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="vlkv's lab: evaluation, benchmarks and the cluster simulator"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in PARSERS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from vlkv.deploy.cli.main import run

    parser = build_parser()
    return run(parser.parse_args(argv), parser.prog)


if __name__ == "__main__":
    sys.exit(main())
