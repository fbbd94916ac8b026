"""``vlkv demo``: a local cluster answering synthetic visual questions with the default model, each also
asked with the full cache, then a summary (``demo_summary.py``)."""

from __future__ import annotations

import asyncio
import sys

from vlkv.deploy.cli.cluster import with_cluster
from vlkv.deploy.cli.flags import POLICY_HELP, add_server_flags


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="start a local cluster and answer synthetic questions with the default model"
    )
    add_server_flags(p)
    p.add_argument("-n", type=int, default=8, help="number of questions")
    p.add_argument("--seed", type=int, default=0)
    # VL-Cache at 10% by default, each question also asked with the full cache for the summary's comparison
    # (`vlkv eval table` measures accuracy across policies and budgets).
    p.add_argument(
        "--policy",
        default="",
        help=POLICY_HELP + " (default: none named, so the server verifies its candidates: --verify)",
    )
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument(
        "--no-compare-full",
        dest="compare_full",
        action="store_false",
        help="do not ask each question a second time with the full cache",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from vlkv.deploy.cli.demo_summary import DemoSummary
    from vlkv.deploy.client import build_request, connect, generate, png_bytes
    from vlkv.deploy.synthetic_task import MAX_NEW_TOKENS, is_correct, make_examples

    examples = make_examples(args.n, seed=args.seed, split="heldout")
    compare = args.compare_full and args.policy != "full"

    async def body(cluster) -> int:
        channel, stub = connect(cluster.address, token=args.api_token, ca=args.tls_ca)
        summary = DemoSummary(args.policy or "verified", args.budget)
        try:
            for i, ex in enumerate(examples):
                images = [png_bytes(im) for im in ex.images]

                def ask(policy, budget, images=images, question=ex.question):
                    req = build_request(
                        images=images,
                        question=question,
                        max_new_tokens=MAX_NEW_TOKENS,
                        policy=policy,
                        budget=budget,
                    )
                    return asyncio.to_thread(generate, stub, req, 300)

                out = await ask(args.policy, args.budget)
                ok = is_correct(out.text, ex)
                ref = await ask("full", None) if compare else None
                summary.add(out, ok, ref, is_correct(ref.text, ex) if ref else None)
                u = out.finished.usage
                print(f"[{i + 1}/{len(examples)}] {len(ex.images)} image(s) | Q: {ex.question}")
                print(f"    A: {out.text.strip()!r} (expected {ex.answer!r}) {'correct' if ok else 'WRONG'}")
                if ref is not None:
                    same = "same" if ref.text.strip() == out.text.strip() else "differs"
                    print(f"    full cache: {ref.text.strip()!r} ({same})")
                print(
                    f"    prompt {u.prompt_tokens} tokens ({u.vision_tokens} vision), generated "
                    f"{u.generated_tokens}, KV kept {u.kv_bytes_kept}/{u.kv_bytes_full} bytes "
                    f"(ratio {u.compression_ratio:.3f}, {u.policy}), TTFT {u.ttft_ms:.0f} ms",
                    flush=True,
                )
                if u.verify:
                    print(
                        f"    verified: kept {u.verified_candidate} at {u.verified_budget:.0%} "
                        f"({u.budget_raises} raises), draft agreement {u.verified_agreement:.3f}"
                        f"{'' if u.floor_met else ' (floor not met)'}",
                        flush=True,
                    )
            pool = await asyncio.to_thread(_decode_pool, cluster.address, args)
        finally:
            channel.close()
        print(summary.render(pool, block_size=args.block_size, max_new_tokens=MAX_NEW_TOKENS))
        return 0 if summary.correct > 0 else 1

    return asyncio.run(with_cluster(args, body))


def _decode_pool(address: str, args) -> tuple[int, int] | None:
    """(blocks, workers) of the first decode worker's pool, from the gateway's admin API."""
    import grpc
    from vlkv.deploy.client import open_channel
    from vlkv.v1 import admin_pb2, admin_pb2_grpc

    try:
        with open_channel(address, token=args.api_token, ca=args.tls_ca) as channel:
            st = admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.StatusRequest(), timeout=10)
    except grpc.RpcError as exc:
        print(f"(no pool figures: the admin API answered {exc.code().name})", file=sys.stderr)
        return None
    decode = [w for w in st.workers if w.kind == "decode" and w.total_blocks]
    return (decode[0].total_blocks, len(decode)) if decode else None
