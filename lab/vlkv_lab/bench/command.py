"""``vlkv bench``: its flags (each benchmark's own from its module) and its dispatch to the benchmarks."""

from __future__ import annotations

from pathlib import Path

from vlkv.common.config import DEFAULT_MODEL_DIR


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark report: vlkv (vlcache, full) against a Hugging Face server")
    p.add_argument(
        "what",
        choices=[
            "all",
            "image-reuse",
            "capacity",
            "kernels",
            "gpu",
            "handoff-latency",
            "soak",
            "kvpress",
            "verify-cost",
            "window-kv",
            "prefix-ttft",
        ],
        help="what to run (all: every table and figure; image-reuse: the image cache's TTFT, accuracy, load; "
        "capacity: sequences per pool with int8 caches and decode re-compression, their wire bytes, int8 vs "
        "fp16 decode speed -> out/bench_capacity; kernels: the Triton kernels (CUDA) or their references "
        "(CPU) beside the roofline cost model -> out/bench_kernels; gpu: on a CUDA machine every GPU "
        "measurement in one report -> out/bench_gpu, on CPU a one-line notice; handoff-latency: p50/p99 of "
        "small gRPC hand-offs and 7B-layout throughput, --before a second checkout in the same run -> "
        "out/bench_handoff); soak: -n requests at --concurrency through a local cluster, pools checked after, "
        "--chaos through both fronts while workers are killed and stopped (lab/vlkv_lab/chaos_soak.py); kvpress "
        "--suite text: NVIDIA kvpress's presses on SmolLM2 over the real-text suite -> out/bench_kvpress; prefix-ttft: a follow-up turn's TTFT from the prefix cache and "
        "continued against a cold prefill at 1K/2K histories, and the hit rate under mixed conversations -> "
        "out/bench_prefix_ttft)",
    )
    p.add_argument("--quick", action="store_true", help="small counts: finishes within 10 minutes on 2 cores")
    p.add_argument("--out", default="out/bench", help="where report.md, results.json and the plots go")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--kv-mb", type=float, default=None, help="KV memory of each system (MiB; default 24)")
    p.add_argument(
        "--kvpress", default="auto", choices=["auto", "off"], help="compare NVIDIA kvpress presses"
    )
    p.add_argument("--no-load", action="store_true", help="image-reuse: skip the load run through the API")
    p.add_argument("--model-only", action="store_true", help="kernels: print the cost model, measure nothing")
    p.add_argument("--before", type=Path, default=None, help="handoff-latency: a checkout to measure beside")
    p.add_argument(
        "--n", type=int, default=1000, help="handoff-latency: hand-offs per size and checkout; soak: requests"
    )
    p.add_argument("--concurrency", type=int, default=64, help="soak: requests in flight")
    p.add_argument("--chaos", action="store_true", help="soak: SIGKILL/SIGSTOP workers during the load")
    p.add_argument("--repeats", type=int, default=7, help="handoff-latency: 7B-layout transfers per budget")
    p.add_argument(
        "--kv-transport",
        default="auto",
        choices=["auto", "nixl", "grpc"],
        help="all: the KV hand-off of the vlkv systems (auto: NIXL where both workers have it)",
    )
    from vlkv_lab.bench.kvpress_text import add_args as add_kvpress_args

    add_kvpress_args(p)
    from vlkv_lab.bench.verify_cost import add_args as add_verify_cost_args

    add_verify_cost_args(p)
    from vlkv_lab.bench.window_kv import add_args as add_window_kv_args

    add_window_kv_args(p)
    from vlkv_lab.bench.prefix_ttft import add_args as add_prefix_ttft_args

    add_prefix_ttft_args(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    if args.what == "kernels":
        from vlkv_lab.bench.kernels import main as run_kernels

        out = args.out if args.out != "out/bench" else "out/bench_kernels"
        run_kernels(["--out", out] + ["--quick"] * args.quick + ["--model-only"] * args.model_only)
        return 0
    if args.what == "gpu":
        from vlkv_lab.bench.gpu import run as run_gpu

        return run_gpu(args.out if args.out != "out/bench" else "out/bench_gpu", args.quick)
    if args.what == "image-reuse":
        from vlkv_lab.bench.image_reuse import run as run_image_reuse

        return run_image_reuse(args.model, args.out, args.quick, load=not args.no_load)
    if args.what == "capacity":
        from vlkv_lab.bench.capacity import run as run_capacity

        return run_capacity(args.out if args.out != "out/bench" else "out/bench_capacity", args.quick)
    if args.what == "soak":
        from vlkv_lab.soak import main as run_soak

        flags = ["-n", str(args.n), "--concurrency", str(args.concurrency), "--model", args.model]
        return run_soak(flags + ["--chaos"] * args.chaos)
    if args.what == "kvpress":
        from vlkv_lab.bench import kvpress_text

        args.out = args.out if args.out != "out/bench" else "out/bench_kvpress"
        return kvpress_text.main(args)
    if args.what == "handoff-latency":
        from vlkv_lab.bench import handoff_latency

        args.out = Path(args.out if args.out != "out/bench" else "out/bench_handoff")
        handoff_latency.main(args)
        return 0
    if args.what == "verify-cost":
        from vlkv_lab.bench import verify_cost

        args.out = args.out if args.out != "out/bench" else "out/bench_verify_cost"
        return verify_cost.main(args)
    if args.what == "prefix-ttft":
        from vlkv_lab.bench import prefix_ttft

        args.out = args.out if args.out != "out/bench" else "out/bench_prefix_ttft"
        return prefix_ttft.main(args)
    if args.what == "window-kv":
        from vlkv_lab.bench import window_kv

        args.out = args.out if args.out != "out/bench" else "out/bench_window_kv"
        return window_kv.main(args)
    from vlkv_lab.bench.compare_systems import run_bench

    return run_bench(args)
