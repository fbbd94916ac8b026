"""``vlkv simulate``: runs side by side (cluster sizes x routing strategies x autoscaler settings) on one
profile and one trace shape, a table and a plot of them.

    vlkv simulate --decode 10 100 1000 --load 0.8 --duration 60
    vlkv simulate --decode 1000 --strategy kv poll best2 random round_robin --duration 20
    vlkv simulate --trace diurnal --autoscale --decode 4 --decode-max 40 --duration 1800 --period 1800
    vlkv simulate --replay out/real_run.json --decode 2 --prefill 1
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from vlkv.deploy.progress import Progress

from vlkv_lab.sim import trace as traces
from vlkv_lab.sim import vclock
from vlkv_lab.sim.box_load import load_series
from vlkv_lab.sim.cluster import SimConfig, Simulation, capacity
from vlkv_lab.sim.profile import DEFAULT_PROFILE, Profile
from vlkv_lab.sim.report import plot, summarize, table


def add_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="the real router, admission queue and autoscaler over simulated workers, in virtual time",
    )
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="service times (vlkv profile's JSON)")
    p.add_argument(
        "--decode", type=int, nargs="+", default=[10], help="decode workers (several: side by side)"
    )
    p.add_argument("--prefill", type=int, default=0, help="prefill workers (default: in proportion)")
    p.add_argument(
        "--load", type=float, default=0.8, help="arrival rate as a share of the cluster's capacity"
    )
    p.add_argument("--rate", type=float, default=0.0, help="arrivals per second (overrides --load)")
    p.add_argument("--trace", default="poisson", choices=traces.KINDS)
    p.add_argument("--replay", default="", help="a recorded run (loadgen --json) to replay instead")
    p.add_argument(
        "--background", default="", help="with --replay: the box's other load beside it (box_load.py --out)"
    )
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds of arrivals")
    p.add_argument("--period", type=float, default=60.0, help="bursty / diurnal period (simulated s)")
    p.add_argument("--warmup", type=float, default=5.0, help="arrivals before this are not in the latencies")
    p.add_argument("--strategy", nargs="+", default=["kv"], help="kv poll best2 random round_robin")
    p.add_argument("--sample-k", type=int, default=4)
    p.add_argument("--gateways", type=int, default=1)
    p.add_argument("--no-charge-cpu", action="store_true", help="the router's CPU time delays no request")
    p.add_argument("--autoscale", action="store_true", help="autoscale between --decode and --decode-max")
    p.add_argument("--decode-max", type=int, default=0)
    p.add_argument("--prefill-max", type=int, default=0)
    p.add_argument("--downscale-delay", type=float, nargs="+", default=[30.0])
    p.add_argument("--min-uptime", type=float, nargs="+", default=[120.0])
    p.add_argument("--target-occupancy", type=float, nargs="+", default=[0.8])
    p.add_argument("--prompt-tokens", type=int, default=48, help="mean text tokens per prompt")
    p.add_argument("--images", type=int, default=1, help="images per request that has images")
    p.add_argument("--image-share", type=float, default=1.0, help="share of requests with images")
    p.add_argument("--image-reuse", type=float, default=0.3, help="share of images from a popular set")
    p.add_argument("--new-tokens", type=int, default=64, help="mean max_new_tokens")
    p.add_argument("--max-batch", type=int, default=0, help="override the profile's decode batch bound")
    p.add_argument("--pool-blocks", type=int, default=0, help="override the profile's decode pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/simulate", help="folder for the JSON and the plot")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_simulate)


def _runs(args, prof: Profile, mix: traces.Mix) -> list[tuple[SimConfig, list]]:
    out = []
    for decode, strategy, delay, uptime, occ in itertools.product(
        args.decode, args.strategy, args.downscale_delay, args.min_uptime, args.target_occupancy
    ):
        background = []
        if args.replay:
            requests, real = traces.replay(args.replay)
            prefill = args.prefill or 1
            if args.background:
                background = load_series(args.background, real.get("started_unix", 0.0))
        else:
            top = max(args.decode_max, decode) if args.autoscale else decode
            cap, prefill_top = capacity(prof, mix, top)
            rate = args.rate or args.load * cap / (traces.peak_rate(args.trace, 1.0))
            prefill = args.prefill or (
                max(1, math.ceil(prefill_top * decode / top)) if args.autoscale else prefill_top
            )
            requests = traces.generate(
                args.trace, rate, args.duration, mix, prof.vision_tokens_per_image, args.seed, args.period
            )
        label = f"d={decode} {strategy}"
        if args.autoscale:
            label += f" delay={delay:g} uptime={uptime:g} occ={occ:g}"
        cfg = SimConfig(
            decode=decode,
            prefill=prefill,
            strategy=strategy,
            sample_k=args.sample_k,
            gateways=args.gateways,
            charge_router_cpu=not args.no_charge_cpu,
            warmup_s=0.0 if args.replay else args.warmup,
            seed=args.seed,
            autoscale=args.autoscale,
            decode_max=args.decode_max,
            prefill_max=args.prefill_max or (
                math.ceil(prefill * max(args.decode_max, decode) / decode) if args.autoscale else 0
            ),
            decode_target=occ,
            downscale_delay_s=delay,
            min_uptime_s=uptime,
            label=label,
            background=background,
        )  # fmt: skip
        out.append((cfg, requests))
    return out


def cmd_simulate(args) -> int:
    prof = Profile.load(args.profile)
    if args.max_batch:
        prof = replace(prof, max_batch=args.max_batch)
    if args.pool_blocks:
        prof = replace(prof, pool_blocks=args.pool_blocks)
    mix = traces.Mix(
        prompt_tokens=args.prompt_tokens,
        images=args.images,
        image_share=args.image_share,
        image_reuse=args.image_reuse,
        new_tokens=args.new_tokens,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, rows = [], []
    for cfg, requests in _runs(args, prof, mix):
        span = int(max((r.arrival for r in requests), default=0)) + 1
        with Progress(span, cfg.label, "sim s", disable=args.quiet) as bar:
            res = vclock.run(Simulation(cfg, prof, requests, bar).run())
        results.append(res)
        rows.append(summarize(res))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    print(f"profile: {args.profile} ({prof.machine})")
    print(table(rows))
    if args.replay:
        _, real = traces.replay(args.replay)
        _print_comparison(real, rows[0])
    (out / "simulate.json").write_text(json.dumps({"runs": rows}, indent=1) + "\n")
    plot(results, str(out / "simulate.png"))
    print(f"wrote {out / 'simulate.json'} and {out / 'simulate.png'}")
    return 0


def _print_comparison(real: dict, sim: dict) -> None:
    """The replayed run's own figures beside the simulator's."""
    pairs = [
        ("TTFT p50 (ms)", real.get("ttft_p50_s", math.nan) * 1e3, sim["ttft_p50_s"] * 1e3),
        ("TTFT p99 (ms)", real.get("ttft_p99_s", math.nan) * 1e3, sim["ttft_p99_s"] * 1e3),
        ("tokens/s", real.get("throughput_tok_s", math.nan), sim["tokens_s"]),
        ("ITL p50 (ms)", real.get("itl_p50_s", math.nan) * 1e3, sim["itl_p50_s"] * 1e3),
    ]
    print(f"{'':16}{'real':>10}{'simulated':>12}{'sim/real':>10}")
    for name, r, s in pairs:
        print(f"{name:16}{r:10.1f}{s:12.1f}{s / r if r else math.nan:10.2f}")


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine's service times for vlkv simulate (a JSON file)")
    p.add_argument(
        "--model", default="", help="local LLaVA checkpoint directory (default: the shipped model)"
    )
    p.add_argument("--out", default="out/profile.json")
    p.add_argument("--quick", action="store_true", help="fewer requests per point")
    p.add_argument(
        "--address", default="", help="measure a running deployment's gateway instead (vlkv serve)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="that deployment's /metrics port (its hand-off times)"
    )
    p.add_argument(
        "--shared-cores", type=float, default=None,
        help="cores the gateway and workers share (default: this machine's when they run here; 0: none)",
    )  # fmt: skip
    p.add_argument(
        "--deployment-pid",
        type=int,
        default=0,
        help="the deployment's process (its threads are not other work)",
    )
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    from vlkv_lab.sim.measure import measure

    prof = measure(
        args.model or None,
        args.quick,
        args.address,
        args.metrics_port,
        args.shared_cores,
        args.deployment_pid,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    prof.save(args.out)
    print(json.dumps(prof.__dict__, indent=1))
    print(f"wrote {args.out}")
    return 0
