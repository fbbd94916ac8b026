"""``vlkv eval``: its flags and its dispatch to the report, the zoo, the protocol and the API check.

Imported when the command line is built, so it imports nothing heavy at module level."""

from __future__ import annotations

from vlkv.common.config import DEFAULT_MODEL_DIR, DEFAULT_PROMPT_WEIGHT
from vlkv.deploy.cli.flags import POLICY_HELP
from vlkv.deploy.jobs import jobs_flag

# Flags that only one mode reads; given to another mode they would be ignored without a word.
API_ONLY = (
    "budgets",
    "concurrency",
    "batch_invariant",
    "dtype",
    "member",
    "compression_profile",
    "api_verify",
)
ZOO_ONLY = ("members", "text_n", "jobs", "text_lengths", "text_tasks", "rows", "verify")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _defaults():
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    add_eval_parser(sub)
    return sub.choices["eval"].parse_args([])


def misplaced_flags(args) -> str:
    """Why ``args`` set a flag its mode ignores ("" when none): only ``--api`` without ``--zoo`` reads the
    serving flags (the zoo runs 1, 2, 5 and 10% and serves the default policy itself), and only the zoo reads
    the members, text and worker flags. A flag counts as set when its value is not the parser's default."""
    if getattr(args, "protocol", None):
        return ""
    defaults = _defaults()

    def given(dests):
        return [_flag(d) for d in dests if getattr(args, d, None) != getattr(defaults, d)]

    def only(extra, where):
        return f"{', '.join(extra)} {'applies' if len(extra) == 1 else 'apply'} only to {where}"

    zoo, api = getattr(args, "zoo", False), getattr(args, "api", False)
    if (not api or zoo) and (extra := given(API_ONLY)):
        why = only(extra, "--api without --zoo")
        return why + (" (--zoo runs 1, 2, 5 and 10%)" if zoo else "")
    if not zoo and (extra := given(ZOO_ONLY)):
        return only(extra, "--zoo")
    if zoo and not getattr(args, "ablation", False) and given(("rows",)):
        return "--rows only applies to --zoo --ablation"
    return ""


def cmd_eval(args) -> int:
    if why := misplaced_flags(args):
        import sys

        print(f"vlkv eval: {why}", file=sys.stderr)
        return 2
    if getattr(args, "protocol", None):
        from vlkv_lab.eval.protocol import run_protocol

        return run_protocol(args)
    if getattr(args, "zoo", False):
        from vlkv_lab.eval.zoo import run_zoo

        return run_zoo(args)
    if args.api:
        from vlkv_lab.eval.api_check import run_api_check

        return run_api_check(args)
    from vlkv_lab.eval.report import run_eval

    return run_eval(args)


def add_eval_parser(sub) -> None:
    """The ``eval`` subcommand on ``sub`` (the ``vlkv`` parser's subparsers)."""
    p = sub.add_parser("eval", help="accuracy of a policy and budget on the default model's held-out split")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--policy", default="vlcache", help=POLICY_HELP)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("-n", type=int, default=200, help="held-out examples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--split",
        choices=["heldout", "train"],
        default="heldout",
        help="examples of the held-out split (figures) or of the training split (choosing a setting)",
    )
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--table", action="store_true", help="sweep every policy over the Table-1 budgets")
    p.add_argument(
        "--ablation",
        action="store_true",
        help="VL-Cache ablations (scorer/allocator/window swaps, kept tokens, hit rates, oracles) -> ablation.md",
    )
    p.add_argument("--allocator", default="", help="layer budget allocator: sparsity, uniform, pyramid, cake")
    p.add_argument(
        "--exact-budget", action="store_true", help="sparsity allocator: hit alpha * L * m exactly"
    )
    p.add_argument(
        "--api",
        action="store_true",
        help="ask every question through a local gateway + workers (real gRPC) at full and --policy at "
        "--budgets; compare with the in-process answers -> api_check.md",
    )
    p.add_argument(
        "--api-verify",
        choices=["floor", "select"],
        default=None,
        help="--api: verified compression instead of --policy: each request names only its budget and this "
        "verify mode, the in-process side runs the same verifier (InProcessEngine) one request at a time; "
        "every usage must carry the verifier's fields and the candidate the in-process verifier kept",
    )
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
    p.add_argument(
        "--kv-table",
        action="store_true",
        help="only the KV storage table: --policy/--budget in fp16 vs --kv-dtype int8, and the task's long "
        "kind (69-token answers, the deciding word 67th) with decode re-compression off vs on -> kv.md "
        "(--table with --kv-dtype or --decode-budget adds it after the sweep)",
    )
    p.add_argument(
        "--zoo",
        action="store_true",
        help="every zoo member (lab/vlkv_lab/zoo) x policy x {1,2,5,10}%%, a table per member and the worst member "
        "(with --ablation: vlcache's options instead of the policies; with --api: the default policy's answers "
        "through real gRPC too) -> zoo.md, zoo.json, zoo.png",
    )
    p.add_argument(
        "--members",
        default="",
        help="--zoo: comma-separated members, `text` the real-text suite (default: all)",
    )
    p.add_argument("--text-n", type=int, default=50, help="--zoo: items per text task and length")
    p.add_argument(
        "--jobs",
        default="auto",
        type=jobs_flag,
        help="--zoo: worker processes of one torch thread each, each running a member or a text task at one "
        "length, the longest first (auto: min(2, CPU cores); 1: everything in this process, as before)",
    )
    p.add_argument(
        "--text-lengths", default="1024,2048", help="--zoo: text prompt lengths in tokens (4096 for the note)"
    )
    p.add_argument(
        "--text-tasks",
        default="",
        help="--zoo: comma-separated text tasks (default: text_suite.DEFAULT_TASKS, three the model does "
        "with the full cache)",
    )
    p.add_argument(
        "--rows", default="", help="--zoo --ablation: only these ABLATION rows (labels, `|`-separated)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="--zoo: also verified compression's rows (verify: floor and select, the server's defaults, through "
        "the in-process stack) beside its fixed candidates' curves and the oracle, per image member -> "
        "zoo.md's verifier section, zoo_verify.png (lab/vlkv_lab/eval/zoo_verify.py)",
    )
    p.add_argument(
        "--protocol",
        nargs="+",
        default=None,
        metavar="ZOO_JSON",
        help="the tuning protocol v2.2 (per prompt kind) recomputed from saved `vlkv eval --zoo --ablation` JSON files (training and "
        "held-out splits; no model is run) -> protocol.md, protocol.json",
    )
    p.add_argument("--budgets", default="0.1,0.05", help="--api: comma-separated budgets")
    p.add_argument("--concurrency", type=int, default=8, help="--api: requests in flight")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="--api: serve with `vlkv serve --batch-invariant` (each sequence decoded as a batch of one) and "
        "decode the in-process side one cache at a time, so both sides decode alone at any --concurrency",
    )
    p.add_argument(
        "--dtype",
        default="",
        choices=["", "float32", "float16", "bfloat16"],
        help="--api: the dtype both sides run in (default: float32, bfloat16 for text:TASK)",
    )
    p.add_argument(
        "--member",
        default="",
        help="--api: a zoo member or text:TASK[:LENGTH] (the real-text suite on SmolLM2, bfloat16) instead of "
        "the default model's synthetic task",
    )
    p.add_argument(
        "--compression-profile",
        default="",
        help="--api: serve this vlkv calibrate profile and check its answers (requests name only a budget) "
        "against the in-process evaluation of each budget's entry",
    )
    p.add_argument("--out", default="out/eval", help="where --table writes table.md and the plot")
    p.set_defaults(func=cmd_eval)
