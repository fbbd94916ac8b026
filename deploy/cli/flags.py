"""The ``vlkv`` command line's shared flags, each defined once: the server's (``serve``, ``demo``), a
client's (``generate``, ``status``) and a request's (``generate``)."""

from __future__ import annotations

import argparse
import os

from vlkv.common.config import DEFAULT_MODEL_DIR, DEFAULT_PROMPT_WEIGHT
from vlkv.deploy.cli.verify_flags import add_verify_flags

POLICY_HELP = "vlcache (default), streamingllm, h2o, zipcache, snapkv, pyramidkv, random, full"


def add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local LLaVA checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (each worker sees the GPU Ray gave it)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (the pool's minimum)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (the pool's minimum)")
    p.add_argument("--prefill-max", type=int, default=None, help="autoscale prefill workers up to this many")
    p.add_argument("--decode-max", type=int, default=None, help="autoscale decode workers up to this many")
    p.add_argument("--prefill-target", type=float, default=2.0, help="ongoing+queued prefills per replica")
    p.add_argument("--decode-target", type=float, default=0.8, help="KV pool occupancy per decode replica")
    p.add_argument("--worker-cpus", type=float, default=1.0, help="CPUs each worker asks Ray for")
    p.add_argument("--worker-gpus", type=float, default=0.0, help="GPUs each worker asks Ray for")
    p.add_argument(
        "--node-groups",
        action="store_true",
        help='place prefill/decode workers on nodes with the custom resources "vlkv_prefill"/"vlkv_decode"',
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--pool-mb", type=float, default=256, help="KV pool size of each decode worker (MiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-batch", type=int, default=64, help="most sequences in one decode step")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="decode each sequence as a batch of one: its tokens do not depend on what else is decoding "
        "(bfloat16/float16 round differently with the batch size), at the cost of throughput",
    )
    p.add_argument(
        "--admission",
        default="grow",
        choices=["grow", "reserve"],
        help="grow: caches take blocks as they decode, the newest is preempted to host memory when the "
        "pool fills; reserve: each cache reserves max_new_tokens at admission",
    )
    p.add_argument("--swap-mb", type=float, default=0, help="host memory for preempted sequences (0: = pool)")
    p.add_argument(
        "--kv-transport",
        choices=["auto", "grpc", "nixl"],
        default="auto",
        help="how caches go from prefill to decode: nixl (one-sided writes into the decode pool, "
        "unencrypted: trusted fabrics only), grpc, or auto (nixl where both workers have it and TLS is off)",
    )
    p.add_argument(
        "--nixl-min-mb",
        type=float,
        default=8.0,
        help="auto: caches smaller than this go over gRPC (NIXL's extra round trip costs more there; 0: none)",
    )
    p.add_argument(
        "--max-unclaimed",
        type=int,
        default=8,
        help="decode side: caches one sending host may park unclaimed at once (a cache a Decode call has "
        "not claimed yet)",
    )
    p.add_argument(
        "--unclaimed-lease-s",
        type=float,
        default=5.0,
        help="decode side: an unclaimed cache is freed after this many seconds",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["fp16", "int8", "fp8"],
        default="fp16",
        help="how compact caches travel and are stored: fp16 (the model's dtype), int8 (KIVI: per-channel "
        "K and per-token V scales; about half the bytes, twice the sequences per pool) or fp8 (E4M3 with "
        "the same scales and bytes)",
    )
    p.add_argument(
        "--decode-budget",
        type=float,
        default=0.0,
        help="decode-phase re-compression (0: off): a layer keeps at most this fraction of its prompt-time "
        "tokens plus --decode-window, dropping the least-attended older tokens as it grows",
    )
    p.add_argument("--decode-window", type=int, default=32, help="recent tokens re-compression always keeps")
    p.add_argument(
        "--prompt-weight",
        type=float,
        default=DEFAULT_PROMPT_WEIGHT,
        help="re-compression: a prompt token's accumulated attention mass starts at this x its prompt-time "
        "score (0: decode-time mass alone)",
    )
    p.add_argument(
        "--max-waiting", type=int, default=256, help="requests queued while no decode worker has room"
    )
    p.add_argument(
        "--malloc-trim-mb",
        type=int,
        default=4,
        help="glibc trim threshold in each worker (MiB): memory a burst of large requests left above it goes "
        "back to the OS; raise it (e.g. 32) where hand-offs of whole uncompressed caches dominate",
    )
    p.add_argument(
        "--image-cache-mb",
        type=int,
        default=256,
        help="each prefill worker's image cache (reused image K/V, LRU) in MiB; 0 = off",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=256,
        help="each prefill worker's prefix cache (prompts' full K/V by block, LRU) in MiB: a follow-up turn "
        "prefills only what follows its longest cached prefix; 0 = off",
    )
    p.add_argument("--prefix-block", type=int, default=16, help="tokens per prefix-cache block")
    p.add_argument(
        "--share-prefixes",
        action="store_true",
        help="one tenant's cached prefixes serve another's prompts (off: each API token has its own)",
    )
    p.add_argument(
        "--compression-profile",
        default="",
        metavar="PATH",
        help="compression profile (vlkv calibrate) for requests that name no policy: the entry nearest their "
        "budget chooses the policy; default: compression_profile.json beside the checkpoint if there is one; "
        "'none': no profile. Another model's profile or a bad file is refused at start-up",
    )
    add_verify_flags(p)
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster (ray://host:10001)")
    p.add_argument(
        "--tls-cert", default="", help="PEM certificate: TLS on every server (public and internal)"
    )
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default="", help="PEM CA bundle that signed the workers' certificates")
    p.add_argument("--mtls", action="store_true", help="workers require and verify client certificates")
    p.add_argument(
        "--api-token", default=os.environ.get("VLKV_API_TOKEN", ""), help="bearer token for clients"
    )
    p.add_argument(
        "--internal-token",
        default=os.environ.get("VLKV_INTERNAL_TOKEN", ""),
        help="secret every internal call carries (default without --mtls: a random one, drawn at start-up)",
    )


def add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token", default=os.environ.get("VLKV_API_TOKEN", ""), help="bearer token (or VLKV_API_TOKEN)"
    )
    p.add_argument("--tls-ca", default="", help="PEM CA bundle to verify the gateway (enables TLS)")


def add_request_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--policy", default="", help=POLICY_HELP)
    p.add_argument("--budget", type=float, default=None, help="KV budget alpha in (0, 1]; default 0.1")
    p.add_argument("--threshold", type=float, default=None, help="sparsity threshold p; default 0.01")
    p.add_argument("--allocator", default="", help="sparsity, uniform, pyramid or cake")
    p.add_argument("--exact-budget", action="store_true")
    p.add_argument(
        "--verify",
        default="",
        choices=["", "off", "select", "floor"],
        help="verified compression (default: the server's for a request that names no policy)",
    )
    p.add_argument("--fidelity-floor", type=float, default=None, help="draft agreement --verify floor asks")
    p.add_argument(
        "--max-budget", type=float, default=None, help="the largest budget --verify floor raises to"
    )


def request_kwargs(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        policy=args.policy,
        budget=args.budget,
        threshold=args.threshold,
        allocator=args.allocator,
        exact_budget=args.exact_budget,
        verify=args.verify,
        fidelity_floor=args.fidelity_floor,
        max_budget=args.max_budget,
    )
