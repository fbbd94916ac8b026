"""``vlkv eval``: one program per subcommand, each with the flags it reads (groups defined once, below).

``vlkv eval`` alone: accuracy of one policy and budget on the default model's held-out split. ``table``: every
policy over the Table-1 budgets; ``kv-table``: the KV storage table; ``ablation``: VL-Cache's ablations on the
default model; ``api``: the answers through a local cluster's gRPC API against the in-process ones; ``zoo``:
every zoo member x policy x budget; ``protocol``: the tuning protocol over saved zoo files.

Imported when the command line is built, so it imports nothing heavy at module level."""

from __future__ import annotations

import argparse
import sys

from vlkv.common.config import DEFAULT_MODEL_DIR, DEFAULT_PROMPT_WEIGHT
from vlkv.deploy.cli.flags import POLICY_HELP
from vlkv.deploy.jobs import jobs_flag

# The flags of the one-mode command line before subcommands, and the subcommand each is now.
MOVED = {
    "table": "table",
    "kv_table": "kv-table",
    "ablation": "ablation",
    "api": "api",
    "zoo": "zoo",
    "protocol": "protocol",
}


def _examples(p: argparse.ArgumentParser, out: str = "out/eval") -> None:
    """Which examples and where the results go: every program but ``protocol``."""
    p.add_argument("-n", type=int, default=200, help="examples (per task and length for the text suite)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--split",
        choices=["heldout", "train"],
        default="heldout",
        help="examples of the held-out split (figures) or of the training split (choosing a setting)",
    )
    p.add_argument("--out", default=out, help="where the report, its JSON and plot go")


def _model(p: argparse.ArgumentParser) -> None:
    """The default model's synthetic task, decoded in process."""
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _policy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="vlcache", help=POLICY_HELP)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--allocator", default="", help="layer budget allocator: sparsity, uniform, pyramid, cake")
    p.add_argument(
        "--exact-budget", action="store_true", help="sparsity allocator: hit alpha * L * m exactly"
    )


def _storage(p: argparse.ArgumentParser) -> None:
    """How the decoded cache is stored, as ``vlkv serve`` stores it."""
    p.add_argument(
        "--kv-dtype", choices=["fp16", "int8", "fp8"], default="fp16", help="how the decoded cache is stored"
    )
    p.add_argument(
        "--decode-budget", type=float, default=0.0, help="decode-phase re-compression (0: off), as in serve"
    )
    p.add_argument("--decode-window", type=int, default=32, help="recent tokens re-compression always keeps")
    p.add_argument(
        "--prompt-weight", type=float, default=DEFAULT_PROMPT_WEIGHT, help="re-compression, as in serve"
    )
    p.add_argument(
        "--min-new-tokens", type=int, default=0, help="long answers: EOS does not end one before this many"
    )


def _api(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budgets", default="0.1,0.05", help="comma-separated budgets")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument(
        "--api-verify",
        choices=["floor", "select"],
        default=None,
        help="verified compression instead of --policy: each request names only its budget and this verify "
        "mode, the in-process side runs the same verifier (InProcessEngine) one request at a time; every "
        "usage must carry the verifier's fields and the candidate the in-process verifier kept",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="serve with `vlkv serve --batch-invariant` (each sequence decoded as a batch of one) and decode the "
        "in-process side one cache at a time, so both sides decode alone at any --concurrency",
    )
    p.add_argument(
        "--dtype",
        default="",
        choices=["", "float32", "float16", "bfloat16"],
        help="the dtype both sides run in (default: float32, bfloat16 for text:TASK)",
    )
    p.add_argument(
        "--member",
        default="",
        help="a zoo member or text:TASK[:LENGTH] (the real-text suite on SmolLM2, bfloat16) instead of the "
        "default model's synthetic task",
    )
    p.add_argument(
        "--compression-profile",
        default="",
        help="serve this vlkv calibrate profile and check its answers (requests name only a budget) against "
        "the in-process evaluation of each budget's entry",
    )


def _zoo(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--members", default="", help="comma-separated members, `text` the real-text suite (default: all)"
    )
    p.add_argument("--text-n", type=int, default=50, help="items per text task and length")
    p.add_argument(
        "--jobs",
        default="auto",
        type=jobs_flag,
        help="worker processes of one torch thread each, each running a member or a text task at one length, "
        "the longest first (auto: min(2, CPU cores); 1: everything in this process)",
    )
    p.add_argument("--text-lengths", default="1024,2048", help="text prompt lengths in tokens")
    p.add_argument(
        "--text-tasks",
        default="",
        help="comma-separated text tasks (default: text_suite.DEFAULT_TASKS, three the model does with the "
        "full cache)",
    )
    p.add_argument(
        "--ablation", action="store_true", help="vlcache's options (ABLATION rows) instead of the policies"
    )
    p.add_argument(
        "--rows", default="", help="with --ablation: only these ABLATION rows (labels, `|`-separated)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="also verified compression's rows (verify: floor and select, the server's defaults, through the "
        "in-process stack) beside the fixed candidates' curves and the oracle, per image member -> zoo.md's "
        "verifier section, zoo_verify.png (lab/vlkv_lab/eval/zoo_verify.py)",
    )
    p.add_argument(
        "--api",
        action="store_true",
        help="the default policy's answers through real gRPC too (a local cluster)",
    )


# program -> (help, flag groups, the mode it sets for the handlers)
PROGRAMS = {
    "table": (
        "every policy x {1,2,5,10,20,100}%% on the default model -> table.md, plot (with --kv-dtype or "
        "--decode-budget: the KV storage table after it)",
        (_examples, _model, _storage),
        {"table": True},
    ),
    "kv-table": (
        "the KV storage table: --policy/--budget in fp16 vs --kv-dtype int8, and the task's long kind (69-token "
        "answers) with decode re-compression off vs on -> kv.md",
        (_examples, _model, _policy, _storage),
        {"kv_table": True},
    ),
    "ablation": (
        "VL-Cache ablations on the default model (scorer/allocator/window swaps, kept tokens, hit rates, "
        "oracles) -> ablation.md",
        (_examples, _model),
        {"ablation": True},
    ),
    "api": (
        "every question through a local gateway + workers (real gRPC) at full and --policy at --budgets, "
        "compared with the in-process answers -> api_check.md",
        (_examples, _model, _policy, _api),
        {"api": True},
    ),
    "zoo": (
        "every zoo member (lab/vlkv_lab/zoo) x policy x {1,2,5,10}%%, a table per member and the worst member "
        "-> zoo.md, zoo.json, zoo.png",
        (_examples, _zoo),
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
    for group in (_examples, _model, _policy, _storage):
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
