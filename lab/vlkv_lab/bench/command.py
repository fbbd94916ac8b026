"""``vlkv bench <program>``: one subcommand per benchmark, each with its own flags (the benchmark's module adds
them) and the shared ones (``--quick``, ``--out``, ``--model``) defined once here."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vlkv.common.config import DEFAULT_MODEL_DIR


@dataclass(frozen=True)
class Program:
    help: str
    out: str | None  # where its report goes by default (None: it writes no report)
    flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    model: bool = False  # takes --model (the checkpoint it serves)
    quick: bool = True  # has a --quick size


def _all_flags(p) -> None:
    p.add_argument("--kv-mb", type=float, default=None, help="KV memory of each system (MiB; default 24)")
    p.add_argument(
        "--kvpress", default="auto", choices=["auto", "off"], help="compare NVIDIA kvpress presses"
    )
    p.add_argument(
        "--kv-transport",
        default="auto",
        choices=["auto", "nixl", "grpc"],
        help="the KV hand-off of the vlkv systems (auto: NIXL where both workers have it)",
    )


def _run_all(args) -> int:
    from vlkv_lab.bench.compare_systems import run_bench

    return run_bench(args)


def _image_reuse_flags(p) -> None:
    p.add_argument("--no-load", action="store_true", help="skip the load run through the API")


def _run_image_reuse(args) -> int:
    from vlkv_lab.bench.image_reuse import run

    return run(args.model, args.out, args.quick, load=not args.no_load)


def _run_capacity(args) -> int:
    from vlkv_lab.bench.capacity import run

    return run(args.out, args.quick)


def _kernels_flags(p) -> None:
    p.add_argument("--model-only", action="store_true", help="print the cost model, measure nothing")


def _run_kernels(args) -> int:
    from vlkv_lab.bench.kernels import main

    main(["--out", args.out] + ["--quick"] * args.quick + ["--model-only"] * args.model_only)
    return 0


def _run_gpu(args) -> int:
    from vlkv_lab.bench.gpu import run

    return run(args.out, args.quick)


def _handoff_flags(p) -> None:
    p.add_argument("--before", type=Path, default=None, help="a second checkout to measure beside this one")
    p.add_argument("--n", type=int, default=1000, help="hand-offs per size and checkout")
    p.add_argument("--repeats", type=int, default=7, help="7B-layout transfers per budget")


def _run_handoff(args) -> int:
    from vlkv_lab.bench import handoff_latency

    args.out = Path(args.out)
    handoff_latency.main(args)
    return 0


def _soak_flags(p) -> None:
    p.add_argument("--n", type=int, default=1000, help="requests")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--chaos", action="store_true", help="SIGKILL/SIGSTOP workers during the load")


def _run_soak(args) -> int:
    from vlkv_lab.soak import main

    flags = ["-n", str(args.n), "--concurrency", str(args.concurrency), "--model", args.model]
    return main(flags + ["--chaos"] * args.chaos)


def _module_flags(name: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p) -> None:
        import importlib

        importlib.import_module(f"vlkv_lab.bench.{name}").add_args(p)

    return add


def _module_main(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args) -> int:
        import importlib

        return importlib.import_module(f"vlkv_lab.bench.{name}").main(args)

    return run


PROGRAMS: dict[str, Program] = {
    "all": Program(
        "every table and figure: vlkv (vlcache, full) against plain Hugging Face generate()",
        "out/bench",
        _all_flags,
        _run_all,
        model=True,
    ),
    "image-reuse": Program(
        "the image cache's TTFT, accuracy and load",
        "out/bench",
        _image_reuse_flags,
        _run_image_reuse,
        model=True,
    ),
    "capacity": Program(
        "sequences per pool with int8 caches and decode re-compression, their wire bytes, int8 vs fp16 decode",
        "out/bench_capacity",
        lambda p: None,
        _run_capacity,
    ),
    "kernels": Program(
        "the Triton kernels (CUDA) or their references (CPU) beside the roofline cost model",
        "out/bench_kernels",
        _kernels_flags,
        _run_kernels,
    ),
    "gpu": Program(
        "on a CUDA machine every GPU measurement in one report; on CPU a one-line notice",
        "out/bench_gpu",
        lambda p: None,
        _run_gpu,
    ),
    "handoff-latency": Program(
        "p50/p99 of small gRPC hand-offs and 7B-layout throughput",
        "out/bench_handoff",
        _handoff_flags,
        _run_handoff,
        quick=False,
    ),
    "soak": Program(
        "requests through a local cluster, the pools checked after (--chaos: workers killed and stopped)",
        None,
        _soak_flags,
        _run_soak,
        model=True,
        quick=False,
    ),
    "kvpress": Program(
        "NVIDIA kvpress's presses on SmolLM2 over the real-text suite",
        "out/bench_kvpress",
        _module_flags("kvpress_text"),
        _module_main("kvpress_text"),
        quick=False,
    ),
    "verify-cost": Program(
        "what the verifier costs per request, by prompt length and kind",
        "out/bench_verify_cost",
        _module_flags("verify_cost"),
        _module_main("verify_cost"),
        quick=False,
    ),
    "window-kv": Program(
        "KV bytes and sequences per pool with sliding windows, per family",
        "out/bench_window_kv",
        _module_flags("window_kv"),
        _module_main("window_kv"),
        quick=False,
    ),
    "prefix-ttft": Program(
        "a follow-up turn's TTFT from the prefix cache and continued, against a cold prefill; the hit rate "
        "under mixed conversations",
        "out/bench_prefix_ttft",
        _module_flags("prefix_ttft"),
        _module_main("prefix_ttft"),
    ),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: one subcommand each (vlkv bench <program> --help)")
    programs = p.add_subparsers(dest="what", required=True, metavar="program")
    for name, program in PROGRAMS.items():
        q = programs.add_parser(name, help=program.help, description=program.help)
        if program.quick:
            q.add_argument(
                "--quick", action="store_true", help="small counts: finishes within 10 minutes on 2 cores"
            )
        if program.out is not None:
            q.add_argument(
                "--out", default=program.out, help=f"where its report goes (default {program.out})"
            )
        if program.model:
            q.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="the checkpoint it serves")
        program.flags(q)
        q.set_defaults(func=program.run)
