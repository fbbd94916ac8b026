"""``vlkv generate``: one request to a running gateway, its answer streamed to stdout and its usage to
stderr."""

from __future__ import annotations

import sys
from pathlib import Path

from vlkv.deploy.cli.flags import add_client_flags, add_request_flags, request_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="send one request to a running gateway and stream the answer")
    p.add_argument("--address", default="127.0.0.1:50051")
    add_client_flags(p)
    p.add_argument("--image", action="append", default=[], help="PNG/JPEG file (repeatable)")
    p.add_argument("--prompt", required=True, help='prompt text; "<image>" marks each image unless --chat')
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat turn after the images")
    p.add_argument("--timeout", type=float, default=300)
    add_request_flags(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    import grpc
    from vlkv.deploy.client import build_request, connect, stream

    images = [Path(p).read_bytes() for p in args.image]
    if args.chat:
        req = build_request(images=images, question=args.prompt, **request_kwargs(args))
    else:
        req = build_request(prompt=args.prompt, images=images, **request_kwargs(args))
    channel, stub = connect(args.address, token=args.token, ca=args.tls_ca)
    try:
        for resp in stream(stub, req, timeout=args.timeout):
            if resp.HasField("token"):
                print(resp.token.text, end="", flush=True)
            else:
                u = resp.finished.usage
                print(
                    f"\n[{_reason(resp.finished.reason)}] prompt {u.prompt_tokens} tokens "
                    f"({u.vision_tokens} vision), generated {u.generated_tokens}, KV kept {u.kv_bytes_kept} of "
                    f"{u.kv_bytes_full} bytes (ratio {u.compression_ratio:.3f}, policy {u.policy}), "
                    f"TTFT {u.ttft_ms:.0f} ms",
                    file=sys.stderr,
                )
                if u.verify:
                    met = "met" if u.floor_met else "NOT met"
                    print(
                        f"verified ({u.verify}): kept {u.verified_candidate}, agreement {u.verified_agreement:.3f} "
                        f"over {u.draft_tokens} draft tokens, KL {u.verified_kl:.4f}, budget {u.verified_budget:g} "
                        f"after {u.budget_raises} raises, floor {met}",
                        file=sys.stderr,
                    )
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    return 0


def _reason(reason: int) -> str:
    from vlkv.v1 import generate_pb2

    return generate_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
