"""``vlkv calibrate`` (a compression profile from a checkpoint's own prompts, or with ``--verifier`` the
served verifier's learned profile) and ``vlkv calibrate-reuse`` (per-layer sensitivity to reused image K/V):
their flags and their runs."""

from __future__ import annotations

import sys

from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.deploy.jobs import jobs_flag


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="choose compression settings per budget on a checkpoint's own prompts (agreement with the full "
        "cache, no labels); write compression_profile.json beside the model",
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument(
        "--prompts",
        required=True,
        help="JSONL, one public-API request per line (deploy/calibrate/prompts.py)",
    )
    p.add_argument("--budgets", default="0.02,0.05,0.1", help="comma-separated budgets in (0, 1)")
    p.add_argument(
        "-n",
        type=int,
        default=64,
        help="at most this many tokens of the full cache's answer compared per prompt (the first included; the "
        "answer ends sooner at its end token)",
    )
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument(
        "--verifier",
        action="store_true",
        help="run the served verifier (its candidates, the 16-token draft) over the prompts instead of the "
        "grid, and write its learned profile (default <model>/learned_profile.json) for --learned-profile",
    )
    p.add_argument(
        "--screen",
        type=int,
        default=12,
        help="successive halving: every candidate on the first N prompts, then per budget only the --keep best "
        "distinct ones and the default (default 12, deploy/calibrate/measure.py DEFAULT_SCREEN; 0: every candidate on "
        "every prompt)",
    )
    p.add_argument(
        "--keep",
        type=int,
        default=6,
        help="with --screen: distinct candidates kept per budget (default 6, DEFAULT_KEEP)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=8,
        help="prompts prefilled and decoded as one batch, the unit a --jobs worker takes",
    )
    p.add_argument(
        "--jobs",
        default="auto",
        type=jobs_flag,
        help="worker processes sharing the prompts, one torch thread each; the same table as one process "
        "(auto: min(2, CPUs); 1: this process)",
    )
    p.add_argument(
        "--trace", default="", help="write each prompt's agreement and KL per candidate (JSON lines)"
    )
    p.add_argument(
        "--rerank",
        type=int,
        default=4,
        help="per budget decode the K best by agreement and the default free-running and rank them by answer "
        "recall first: the share of the full cache's answer words the question does not give found in theirs, "
        "each word weighted by its rarity in the prompt, 1/(1 + its count) (default 4; 0: off, the agreement "
        "ranking alone)",
    )
    p.add_argument(
        "--rerank-prompts",
        type=int,
        default=40,
        help="with --rerank: decode free-running on the first N prompts only (0: all; the rerank set is chosen "
        "on every prompt's agreement)",
    )
    p.add_argument("--dtype", default="float32", help="the dtype the model will be served in (fingerprinted)")
    p.add_argument("--out", default="", help="where to write (default: <model>/compression_profile.json)")
    p.set_defaults(func=cmd_calibrate)


def add_reuse_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate-reuse",
        help="measure per-layer sensitivity to reused image K/V; write reuse_calibration.json beside the model",
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("-n", type=int, default=8, help="examples (synthetic task, training split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="where to write (default: <model>/reuse_calibration.json)")
    p.set_defaults(func=cmd_calibrate_reuse)


def cmd_calibrate(args) -> int:
    from vlkv.deploy.calibrate.measure import calibrate, format_table
    from vlkv.deploy.pool import WorkerFailed

    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if args.verifier:
        from vlkv.deploy.calibrate.verifier import calibrate_verified, format_learned

        path, profile, seconds = calibrate_verified(
            args.model, args.prompts, budgets, args.out, args.dtype, args.max_prompts
        )
        print(format_learned(profile))
        print(f"\nwrote {path} ({profile.label}) in {seconds:.0f} s: serve it with --learned-profile {path}")
        return 0
    try:
        path, profile, seconds = calibrate(
            args.model,
            args.prompts,
            budgets,
            args.n,
            args.out,
            args.dtype,
            args.max_prompts,
            chunk=args.chunk,
            screen=args.screen,
            keep=args.keep,
            trace=args.trace,
            jobs=args.jobs,
            rerank=args.rerank,
            rerank_prompts=args.rerank_prompts,
        )
    except WorkerFailed as err:  # its traceback, then which prompts and why
        print(f"calibrate worker {err.worker}:\n{err.error}", file=sys.stderr)
        print(f"vlkv calibrate: calibrate {err}", file=sys.stderr)
        return 1
    print(format_table(profile))
    chosen = ", ".join(f"{e.budget:g}: {e.candidate}" for e in profile.entries)
    print(f"\nchosen: {chosen}\nwrote {path} ({profile.label}) in {seconds:.0f} s")
    return 0


def cmd_calibrate_reuse(args) -> int:
    from vlkv.deploy.calibrate.reuse import run

    path = run(args.model, n=args.n, seed=args.seed, out=args.out)
    print(f"wrote {path}")
    return 0
