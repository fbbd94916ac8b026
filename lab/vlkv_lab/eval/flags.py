"""``vlkv eval``'s flag groups, each defined once: a program takes the groups it reads (``command.py``)."""

from __future__ import annotations

import argparse

from vlkv.common.config import DEFAULT_MODEL_DIR, DEFAULT_PROMPT_WEIGHT
from vlkv.deploy.cli.flags import POLICY_HELP
from vlkv.deploy.jobs import jobs_flag

__all__ = ["api", "examples", "model", "policy", "storage", "zoo"]


def examples(p: argparse.ArgumentParser, out: str = "out/eval") -> None:
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


def model(p: argparse.ArgumentParser) -> None:
    """The default model's synthetic task, decoded in process."""
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def policy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="vlcache", help=POLICY_HELP)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--allocator", default="", help="layer budget allocator: sparsity, uniform, pyramid, cake")
    p.add_argument(
        "--exact-budget", action="store_true", help="sparsity allocator: hit alpha * L * m exactly"
    )


def storage(p: argparse.ArgumentParser) -> None:
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


def api(p: argparse.ArgumentParser) -> None:
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


def zoo(p: argparse.ArgumentParser) -> None:
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
