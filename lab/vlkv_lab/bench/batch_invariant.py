"""What ``--batch-invariant`` costs and what it buys: decode steps of a real model, batched as usual and
batch-invariant (``PoolConfig.batch_invariant``: on CPU groups of one shape, each sequence attending alone),
side by side in one run.

For each batch size: the time of one decode step (``ModelRunner.step``, median of ``--reps``, the two modes
interleaved) and tokens per second, and against each sequence's solo step in the same mode (what a server in
that mode gives it decoding alone) the share of sequences whose logits are the same bits and the number whose greedy token differs. The caches are random K/V of
``--prompt``, ``--prompt`` - 13, ... tokens per layer (what a step costs depends on their length, not their values).

    python -m vlkv_lab.bench.batch_invariant [--model DIR] [--dtype bfloat16] [--batches 1,4,16] \
        [--prompt 512] [--reps 7] [--out out/bench_batch_invariant]

Default model: SmolLM2-135M-Instruct's text-only wrapper (``lab/vlkv_lab/zoo/smollm2.py``, built if missing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

MODES = ("batched", "batch-invariant")


def _batch(spec, cache, n: int, prompt: int, first_block: int):
    from vlkv.decode_worker.model_runner import StepInput

    layers = spec.kv_layout[0]
    blocks = (prompt + 1 + cache.block_size - 1) // cache.block_size
    out = []
    for i in range(n):  # lengths differ, as a served batch's do: prompt, prompt - 13, ...
        length = max(1, prompt - 13 * i)
        start = first_block + i * layers * blocks
        tables = [list(range(start + j * blocks, start + (j + 1) * blocks)) for j in range(layers)]
        tables = [t[: (length + 1 + cache.block_size - 1) // cache.block_size] for t in tables]
        out.append(StepInput(token=100 + i, position=length, tables=tables, lengths=[length] * layers))
    return out


def run(args) -> list[dict]:
    from vlkv.common.config import ModelConfig
    from vlkv.common.model.loading import load_model
    from vlkv.common.model.spec import ModelSpec
    from vlkv.decode_worker.kv_cache import KVCache
    from vlkv.decode_worker.model_runner import ModelRunner

    model = load_model(ModelConfig(path=args.model, dtype=args.dtype))
    spec = ModelSpec.from_model(model)
    layers, kv_heads, head_dim, dtype = spec.kv_layout
    batches = [int(b) for b in args.batches.split(",")]
    blocks = (args.prompt + 16) // 16 * layers * max(batches)
    cache = KVCache(blocks, 16, kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(0)
    for t in (cache.k, cache.v):
        t.copy_((torch.randn(t.shape, generator=g) * 0.5).to(t.dtype))
    runners = {"batched": ModelRunner(model, cache), "batch-invariant": ModelRunner(model, cache, True)}
    rows = []
    for n in batches:
        batch = _batch(spec, cache, n, args.prompt, 0)
        # each mode against its own solo step: what a server in that mode gives a sequence decoding alone
        # (a step rewrites its token's slot alike)
        solo = {mode: [runners[mode].step([s]) for s in batch] for mode in MODES}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        logits = {mode: runners[mode].step(batch) for mode in MODES}  # untimed: warm each path once
        for _ in range(args.reps):
            for mode in MODES:
                t0 = time.perf_counter()
                logits[mode] = runners[mode].step(batch)
                times[mode].append(time.perf_counter() - t0)
        for mode in MODES:
            step = statistics.median(times[mode])
            same = sum(torch.equal(logits[mode][i : i + 1], solo[mode][i]) for i in range(n))
            flips = sum(int(logits[mode][i].argmax() != solo[mode][i][0].argmax()) for i in range(n))
            rows.append(
                {
                    "batch": n,
                    "mode": mode,
                    "step_ms": step * 1e3,
                    "tokens_per_s": n / step,
                    "same_bits": same,
                    "greedy_differs": flips,
                }
            )
            print(
                f"batch {n:3d}  {mode:15s}  {step * 1e3:8.1f} ms/step  {n / step:7.1f} tok/s  "
                f"solo bits {same}/{n}  greedy differs {flips}/{n}",
                flush=True,
            )
    return rows


def _markdown(rows: list[dict], args) -> str:
    lines = [
        f"# Batch-invariant decoding: {args.model} ({args.dtype}), {args.prompt}-token caches, "
        f"median of {args.reps} steps",
        "",
        "| batch | mode | ms / step | tokens / s | x batched | logits = solo (bits) | greedy token differs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "batched"}
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['mode']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / base[r['batch']]:.2f} | {r['same_bits']}/{r['batch']} | "
            f"{r['greedy_differs']}/{r['batch']} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mode in MODES:
        pts = [(r["batch"], r["tokens_per_s"]) for r in rows if r["mode"] == mode]
        ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences in the step")
    ax.set_ylabel("tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="checkpoint directory (default: the SmolLM2 text wrapper)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt", type=int, default=512, help="cached tokens per layer and sequence")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per mode and batch")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default="out/bench_batch_invariant")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.model:
        from vlkv_lab.zoo.smollm2 import text_checkpoint

        args.model = str(text_checkpoint())
    rows = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_invariant.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / "batch_invariant.md").write_text(_markdown(rows, args))
    _plot(rows, out / "batch_invariant.png")
    print(_markdown(rows, args))
    print(f"wrote {out}/batch_invariant.md, .json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
