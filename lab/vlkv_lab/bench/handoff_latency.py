"""Hand-off latency: how long one small cache takes from the prefill side's ``GrpcKVSender.send`` to the
decode side's ack, over loopback, and throughput at the 7B layout.

The receiver is the decode worker's own ``TransferKV`` receiving side without a model
(``lab/vlkv_lab/bench/kv_receiver.py``: admission, the pool, arrival; each cache freed on arrival) in its own
process; the sender is the prefill worker's ``GrpcKVSender`` on one long-lived channel, each hand-off a new
request with the header a prefill worker sends (sampling, EOS ids, prompt-time scores).

Latency: caches of the default model's layout (4 layers, 2 KV heads, head dim 32, fp32: 2 KiB per token
over all layers) at 12 KB, 120 KB and 1.2 MB (6, 60 and 600 tokens per layer, a 10% cache of a prompt ten
times as long); p50 and p99 over ``--n`` hand-offs (1,000) after a warm-up. Throughput: the 7B layout of
``kv_wire`` (32 layers, 8 KV heads, head dim 128, fp16, 2K-token prompt) at 10% and 100%, GB/s of payload,
median over ``--repeats``.

``--before PATH`` measures a second checkout (e.g. ``git worktree add /tmp/before <commit>``) in the same
run: each tree gets its own worker process (importing ``vlkv`` from that tree, running this file's
``worker``; only APIs both trees have are used) with its own receiver, and the two are interleaved in
rounds so both see the same machine load.

    python -m vlkv_lab.bench.handoff_latency [--before /tmp/before] [--n 1000] [--out out/bench_handoff]
    vlkv bench handoff-latency [--before /tmp/before]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("VLKV_BENCH_TREE"):  # a worker for another checkout: import vlkv from it alone, never
    # falling back to this checkout's editable install for a module that checkout lacks
    sys.meta_path[:] = [
        f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
    ]

DEFAULT_LAYOUT = (4, 2, 32, "float32")  # the default model's (common/default_model/config.json), fp32
SIZES = {"12 KB": 6, "120 KB": 60, "1.2 MB": 600}  # tokens per layer
LAYOUT_7B = (32, 8, 128, "float16")
PROMPT_7B = 2048
BUDGETS_7B = (0.1, 1.0)
ROUNDS = 4  # latency: each tree runs n / ROUNDS hand-offs per round, trees alternating
PACKAGES = {  # vlkv's package-dir table (pyproject.toml): how a checkout's folders become ``vlkv.*``
    "v1": "protos/vlkv/v1",
    "common": "common",
    "kernels": "kernels",
    "prefill_worker": "prefill_worker",
    "decode_worker": "decode_worker",
    "services": "services",
    "deploy": "deploy",
    "tools": "tools",  # the lab, in a checkout from before it became vlkv_lab (lab/vlkv_lab)
}


# -- the worker: runs in each tree's own process -----------------------------------------------------
def _cache(layout, k: int, m: int, seed: int):
    import torch
    from vlkv.common.handoff.compact_kv import CompactKV

    layers, heads, dim, dtype = layout
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(heads, k, dim, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(heads, k, dim, generator=g).to(dtype) for _ in range(layers)]
    scores = [torch.rand(k, generator=g) for _ in range(layers)]
    return CompactKV(keys, values, prompt_length=m, first_token=1, prompt_scores=scores)


def worker() -> None:
    """Serve commands from stdin (one JSON per line), answer one JSON line each on stdout."""
    import asyncio
    import multiprocessing as mp

    import grpc
    import torch
    from vlkv.common.handoff.grpc_transport import GrpcKVSender, grpc_message_options, tune_malloc
    from vlkv.common.handoff.wire import compact_header
    from vlkv.v1 import generate_pb2

    from vlkv_lab.bench import kv_receiver

    tune_malloc()
    torch.set_num_threads(1)
    layouts = [_layout_of(DEFAULT_LAYOUT), _layout_of(LAYOUT_7B)]
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve, args=(layouts, port_q, stop), daemon=True)
    proc.start()
    ports = [p for p, _ in port_q.get(timeout=120)]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # the channels bind to it
    options = grpc_message_options()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=options) for p in ports]
    senders = [GrpcKVSender(ch, timeout_s=120) for ch in channels]
    sampling = generate_pb2.SamplingParams(max_new_tokens=64, temperature=0.0, seed=1)
    ids = iter(range(1 << 40))

    async def send(sender, ckv) -> float:
        header = compact_header(
            ckv,
            request_id=f"h{next(ids)}",
            fingerprint=kv_receiver.FINGERPRINT,
            sampling=sampling,
            eos_token_ids=[2],
            prompt_tokens=ckv.prompt_length,
            policy="vlcache",
        )
        start = time.perf_counter()
        ack = await sender.send(header, ckv)
        elapsed = time.perf_counter() - start
        assert ack.bytes_received == ckv.nbytes, ack
        return elapsed

    print(json.dumps({"ready": True}), flush=True)
    caches: dict = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        big = cmd["op"] == "throughput"
        key = (cmd["op"], cmd["arg"])
        if key not in caches:
            if big:
                k = min(PROMPT_7B, round(cmd["arg"] * PROMPT_7B))
                caches[key] = _cache(LAYOUT_7B, k, PROMPT_7B, 0)
            else:
                caches[key] = _cache(DEFAULT_LAYOUT, cmd["arg"], 10 * cmd["arg"], 0)
        ckv, sender = caches[key], senders[1 if big else 0]
        secs = [loop.run_until_complete(send(sender, ckv)) for _ in range(cmd["n"])]
        print(json.dumps({"seconds": secs, "bytes": ckv.nbytes}), flush=True)
    for ch in channels:
        loop.run_until_complete(ch.close())
    stop.set()
    proc.join(10)


def _serve(layouts, port_q, stop) -> None:
    """The receiver process: ``kv_receiver.serve`` (no NIXL), without per-request log lines (the old
    receiver logs every cache it frees unclaimed; a decode worker's caches are claimed)."""
    import logging

    from vlkv_lab.bench import kv_receiver

    logging.disable(logging.WARNING)
    kv_receiver.serve(layouts, port_q, stop, 320, None, False)


def _layout_of(layout):
    import torch

    layers, heads, dim, dtype = layout
    return (layers, heads, dim, getattr(torch, dtype))


# -- the orchestrator ---------------------------------------------------------------------------------
def _shim(tree: Path) -> str:
    """A folder whose ``vlkv`` package is ``tree``'s folders (as the editable install maps this one) and whose
    ``vlkv_lab`` is its lab."""
    root = Path(tempfile.mkdtemp(prefix="vlkv-tree-"))
    pkg = root / "vlkv"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, folder in PACKAGES.items():
        if (tree / folder).is_dir():
            (pkg / name).symlink_to(tree.resolve() / folder)
    lab = tree / "lab" / "vlkv_lab"  # that checkout's lab, beside its ``vlkv``
    if not lab.is_dir():  # a checkout from before the lab had a package of its own: its tools folder
        lab = tree / "tools"
    (root / "vlkv_lab").symlink_to(lab.resolve())
    return str(root)


class _Tree:
    """A worker process of ``script`` (``script --worker``: JSON commands in, one JSON line out each)
    importing ``vlkv`` from ``tree`` (None: this checkout)."""

    def __init__(self, name: str, tree: Path | str | None, script: str = __file__) -> None:
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = os.pathsep.join([_shim(Path(tree)), env.get("PYTHONPATH", "")])
            env["VLKV_BENCH_TREE"] = str(tree)
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, script, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert json.loads(self.proc.stdout.readline())["ready"]

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def run(self, op: str, arg, n: int) -> dict:
        return self.ask({"op": op, "arg": arg, "n": n})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(30)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(before: Path | None, n: int, repeats: int, warmup: int = 50) -> dict:
    trees = [_Tree("this tree", None)] + ([_Tree(f"before ({before})", before)] if before else [])
    try:
        latency = {}
        for label, k in SIZES.items():
            got = {t.name: [] for t in trees}
            for t in trees:
                t.run("latency", k, warmup)
            for _ in range(ROUNDS):
                for t in trees:
                    got[t.name] += t.run("latency", k, n // ROUNDS)["seconds"]
            latency[label] = got
        throughput = {}
        for budget in BUDGETS_7B:
            got = {t.name: [] for t in trees}
            for t in trees:
                t.run("throughput", budget, 1)
            nbytes = 0
            for _ in range(repeats):
                for t in trees:
                    r = t.run("throughput", budget, 1)
                    got[t.name] += r["seconds"]
                    nbytes = r["bytes"]
            throughput[f"{budget:.0%}"] = {
                name: nbytes / statistics.median(s) / 1e9 for name, s in got.items()
            }
    finally:
        for t in trees:
            t.close()
    return dict(latency=latency, throughput=throughput, trees=[t.name for t in trees], n=n, repeats=repeats)


def report(res: dict, out: Path) -> None:
    names = res["trees"]
    print(f"hand-off latency over loopback, {res['n']} hand-offs per size and tree, load avg {_load()}")
    print(
        "cache      "
        + "".join(f"| {name:>28} p50 / p99 ms " for name in names)
        + ("| p50 after/before" if len(names) > 1 else "")
    )
    rows = {}
    for label, got in res["latency"].items():
        cells = {name: (_pct(got[name], 0.5) * 1e3, _pct(got[name], 0.99) * 1e3) for name in names}
        rows[label] = cells
        line = f"{label:<10} " + "".join(f"| {cells[n][0]:>22.3f} / {cells[n][1]:>8.3f} " for n in names)
        if len(names) > 1:
            line += f"| {cells[names[0]][0] / cells[names[1]][0]:>6.2f}"
        print(line)
    print(f"throughput at the 7B layout (GB/s of payload, median of {res['repeats']}):")
    for budget, got in res["throughput"].items():
        print(f"  {budget:>5}: " + ", ".join(f"{name} {got[name]:.2f}" for name in names))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(res, summary=rows), indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(res["latency"])
    for i, name in enumerate(names):
        ax.bar(
            [x + (i - (len(names) - 1) / 2) * 0.35 for x in range(len(labels))],
            [rows[lb][name][0] for lb in labels],
            0.35,
            label=name,
        )
    ax.set(
        title="hand-off latency p50 (ms), loopback",
        xticks=range(len(labels)),
        xticklabels=labels,
        ylabel="ms",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bench_handoff_latency.png", dpi=120)
    print(f"saved {out / 'bench_handoff_latency.png'} and {out / 'results.json'}")


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--before", type=Path, default=None, help="a second checkout to measure in the same run")
    ap.add_argument("--n", type=int, default=1000, help="hand-offs per size and tree")
    ap.add_argument("--repeats", type=int, default=7, help="7B-layout transfers per budget and tree")
    ap.add_argument("--out", type=Path, default=Path("out/bench_handoff"))


def main(args: argparse.Namespace | None = None) -> None:
    if args is None:
        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        add_arguments(ap)
        args = ap.parse_args()
    report(run(args.before, args.n, args.repeats), args.out)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        # run as a script: its folder is sys.path[0], where lab/vlkv_lab/bench/kernels.py would pass for the
        # ``kernels`` package transformers looks for
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        worker()
    else:
        main()
