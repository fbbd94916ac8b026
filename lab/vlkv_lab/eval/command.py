"""``vlkv eval``: one program per subcommand, each with the flags it reads (groups defined once, below).

``vlkv eval`` alone: accuracy of one policy and budget on the default model's held-out split. ``table``: every
policy over the Table-1 budgets; ``kv-table``: the KV storage table; ``ablation``: VL-Cache's ablations on the
default model; ``api``: the answers through a local cluster's gRPC API against the in-process ones; ``zoo``:
every zoo member x policy x budget; ``protocol``: the tuning protocol over saved zoo files.

Imported when the command line is built, so it imports nothing heavy at module level."""

from __future__ import annotations

import argparse
import sys

from vlkv_lab.eval import flags

# The flags of the one-mode command line before subcommands, and the subcommand each is now.
MOVED = {
    "table": "table",
    "kv_table": "kv-table",
    "ablation": "ablation",
    "api": "api",
    "zoo": "zoo",
    "protocol": "protocol",
}


# program -> (help, flag groups, the mode it sets for the handlers)
PROGRAMS = {
    "table": (
        "every policy x {1,2,5,10,20,100}%% on the default model -> table.md, plot (with --kv-dtype or "
        "--decode-budget: the KV storage table after it)",
        (flags.examples, flags.model, flags.storage),
        {"table": True},
    ),
    "kv-table": (
        "the KV storage table: --policy/--budget in fp16 vs --kv-dtype int8, and the task's long kind (69-token "
        "answers) with decode re-compression off vs on -> kv.md",
        (flags.examples, flags.model, flags.policy, flags.storage),
        {"kv_table": True},
    ),
    "ablation": (
        "VL-Cache ablations on the default model (scorer/allocator/window swaps, kept tokens, hit rates, "
        "oracles) -> ablation.md",
        (flags.examples, flags.model),
        {"ablation": True},
    ),
    "api": (
        "every question through a local gateway + workers (real gRPC) at full and --policy at --budgets, "
        "compared with the in-process answers -> api_check.md",
        (flags.examples, flags.model, flags.policy, flags.api),
        {"api": True},
    ),
    "zoo": (
        "every zoo member (lab/vlkv_lab/zoo) x policy x {1,2,5,10}%%, a table per member and the worst member "
        "-> zoo.md, zoo.json, zoo.png",
        (flags.examples, flags.zoo),
        {"zoo": True},
    ),
}


def _protocol_parser(sub) -> None:
    p = sub.add_parser(
        "protocol",
        help="the tuning protocol v2.2 (per prompt kind) recomputed from saved `vlkv eval zoo --ablation` JSON "
        "files (training and held-out splits; no model is run) -> protocol.md, protocol.json",
    )
    p.add_argument("protocol", nargs="+", metavar="ZOO_JSON")
    p.add_argument("--out", default="out/eval")
    p.set_defaults(func=cmd_eval, mode="protocol")


def add_eval_parser(sub) -> None:
    """``vlkv eval`` and its programs on ``sub`` (the ``vlkv`` parser's subparsers)."""
    p = sub.add_parser("eval", help="accuracy of compression: one policy and budget, or a program (eval -h)")
    for group in (flags.examples, flags.model, flags.policy, flags.storage):
        group(p)
    for dest in MOVED:  # the one-mode flags: a clear error that names the program instead
        p.add_argument("--" + dest.replace("_", "-"), action=_Moved, nargs=0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_eval, mode="")
    programs = p.add_subparsers(dest="program", metavar="PROGRAM")
    for name, (help_text, groups, mode) in PROGRAMS.items():
        q = programs.add_parser(name, help=help_text)
        for group in groups:
            group(q)
        q.set_defaults(func=cmd_eval, mode=name, **mode)
    _protocol_parser(programs)


class _Moved(argparse.Action):
    """A one-mode flag (``--zoo``): exit 2 at once, naming the program that replaced it."""

    def __call__(self, parser, namespace, values, option_string=None):
        program = MOVED[self.dest]
        parser.exit(2, f"vlkv eval: {option_string} is a program now: vlkv eval {program} (vlkv eval -h)\n")


def _defaults() -> dict:
    """Every flag's default over all programs, and the programs' modes off: what a handler reads of a
    program that has no such flag (the handlers are shared: ``report.run_eval`` runs four of them)."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_eval_parser(sub)
    eval_parser = sub.choices["eval"]
    out = {dest: False for dest in MOVED} | {"protocol": None}
    programs = next(a for a in eval_parser._actions if isinstance(a, argparse._SubParsersAction))
    for q in [eval_parser, *programs.choices.values()]:
        for action in q._actions:
            if action.dest not in ("help", "program"):
                out.setdefault(action.dest, action.default)
    return out


def cmd_eval(args) -> int:
    if args.mode == "zoo" and args.rows and not args.ablation:
        print("vlkv eval zoo: --rows only applies with --ablation (they are ABLATION rows)", file=sys.stderr)
        return 2
    for dest, default in _defaults().items():
        if not hasattr(args, dest):
            setattr(args, dest, default)
    if args.mode == "protocol":
        from vlkv_lab.eval.protocol import run_protocol

        return run_protocol(args)
    if args.mode == "zoo":
        from vlkv_lab.eval.zoo import run_zoo

        return run_zoo(args)
    if args.mode == "api":
        from vlkv_lab.eval.api_check import run_api_check

        return run_api_check(args)
    from vlkv_lab.eval.report import run_eval

    return run_eval(args)
