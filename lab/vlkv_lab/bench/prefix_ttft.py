"""``vlkv bench prefix-ttft``: a conversation's follow-up turn with the prefill worker's prefix cache against
a cold prefill, through the public gRPC API of a local cluster (gateway, prefill and decode workers, real
gRPC on loopback), on SmolLM2-135M-Instruct (the lab's text-only LLaVA wrapper of the real decoder).

Part 1, TTFT: per history length (about 1K and 2K tokens: a RULER-style document and its question, the
reference answer, then a follow-up question), each conversation's first turn is sent (it fills the prefix
cache and, sent with ``conversation: continue``, keeps its compact cache), then its follow-up three times:
cold (``reuse: off``: no cache read nor filled), from the prefix cache (the default: the history's K/V from
the cache, the whole prompt re-compressed for the new question), continued on the decode worker (``continue``,
unverified: the decode worker's own cache of the first turn, its answer included, the rest of the prompt fed
there, no prefill and no hand-off) and continued on the prefill worker (the same request with the gateway's
record of kept turns hidden: the new tokens appended to the first turn's compact cache the prefill worker
kept, then handed off), in an order rotated per conversation so the machine's drift falls on all four. TTFT
is the client's, from the call to the first token; p50/p99 over the conversations.

Part 2, hit rate under a mixed load: conversations of three turns, a few at once (a new one starts as one
ends), on two prefill workers whose prefix caches hold a few conversations each (``--mixed-cache-mb``): the share of
follow-up prompt tokens served from a prefix cache, with the gateway routing by prefix and without (the
router's prefix index off: the least-loaded worker), side by side in one run.

Prints the tables, writes ``prefix_ttft.md``, ``prefix_ttft.json`` and ``prefix_ttft.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from pathlib import Path

import grpc
from vlkv.common.config import ModelConfig, ServerConfig
from vlkv.services.kept_turns import KeptTurns
from vlkv.services.prefix_index import PrefixIndex
from vlkv.v1 import generate_pb2, generate_pb2_grpc

FOLLOW_UPS = (
    "Thank you. Please say the number once more, and nothing else.",
    "Which key did I ask about? Answer in a few words.",
    "Was the number in the first or the second half of the text?",
)


def _serve(cfg: ServerConfig, model, processor, prefills: int = 1):
    """A gateway, ``prefills`` prefill workers and one decode worker on a background event loop."""
    from vlkv.deploy.servers import start_decode_worker, start_gateway, start_prefill_worker

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(300)

    workers = [run(start_prefill_worker(cfg, model=model, processor=processor)) for _ in range(prefills)]
    decode = run(start_decode_worker(cfg, model=model, tokenizer=processor.tokenizer))
    for w in workers:
        w.servicer.allow_decode(decode.address)
    gateway = run(start_gateway(cfg, [w.address for w in workers], [decode.address], processor=processor))

    def stop():
        for r in (gateway, *workers, decode):
            run(r.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return gateway, workers, stop


def _request(
    messages: list[tuple[str, str]], budget: float, reuse: str = "auto", conversation: str = ""
) -> generate_pb2.GenerateRequest:
    chat = generate_pb2.ChatPrompt(
        messages=[
            generate_pb2.ChatMessage(role=role, content=[generate_pb2.ContentPart(text=text)])
            for role, text in messages
        ]
    )
    return generate_pb2.GenerateRequest(
        chat=chat,
        sampling=generate_pb2.SamplingParams(max_new_tokens=4, temperature=0.0),
        compression=generate_pb2.CompressionParams(policy="vlcache", budget=budget),
        reuse=generate_pb2.ReuseParams(reuse=reuse, conversation=conversation),
    )


def _call(stub, req) -> dict:
    start = time.perf_counter()
    ttft, usage = None, None
    for resp in stub.Generate(req, timeout=600):
        if ttft is None:
            ttft = time.perf_counter() - start
        if resp.HasField("finished"):
            usage = resp.finished.usage
    return {
        "ttft_s": ttft,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_prompt_tokens,
        "continued_tokens": usage.continued_tokens,
        "continued_on": usage.continued_on,
        "ratio": usage.compression_ratio,
    }


def conversations(
    tokenizer, length: int, n: int, seed: int, split: str = "heldout"
) -> list[list[tuple[str, str]]]:
    """``n`` three-turn conversations over a ``length``-token document: (role, text) messages with the
    reference answers of the earlier turns and the last turn's question."""
    from vlkv_lab.zoo import text_suite as ts

    out = []
    for i, item in enumerate(ts.items("needle", length, split=split, n=n, seed=seed, tokenizer=tokenizer)):
        rng = random.Random(f"prefix-ttft/{seed}/{length}/{i}")
        follow = rng.sample(FOLLOW_UPS, 2)
        out.append(
            [("user", item.text), ("assistant", item.answer), ("user", follow[0]),
             ("assistant", item.answer), ("user", follow[1])]
        )  # fmt: skip
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


CONDITIONS = ("cold", "prefix cache", "continue (decode)", "continue (prefill)")


def measure_ttft(gateway, stub, convs: list, budget: float) -> dict:
    records: dict[str, list[dict]] = {label: [] for label in CONDITIONS}
    order = [
        ("cold", "off", ""),
        ("prefix cache", "auto", ""),
        ("continue (decode)", "auto", "continue"),
        ("continue (prefill)", "auto", "continue"),
    ]
    router = gateway.servicer.router
    for i, conv in enumerate(convs):
        # the first turn fills the prefix cache and, sent with "continue", is kept by both workers
        _call(stub, _request(conv[:1], budget, conversation="continue"))
        follow = conv[:3]
        for label, reuse, mode in order[i % 4 :] + order[: i % 4]:  # rotated: drift falls on all four
            kept = router.kept
            if label == "continue (prefill)":  # the gateway forgets the kept turn: the prefill worker's path
                router.kept = KeptTurns()
            try:
                records[label].append(_call(stub, _request(follow, budget, reuse, mode)))
            finally:
                router.kept = kept
    out = {}
    for label, recs in records.items():
        t = [r["ttft_s"] for r in recs]
        out[label] = {
            "n": len(recs),
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in recs),
            "cached_tokens": statistics.mean(r["cached_tokens"] for r in recs),
            "continued_tokens": statistics.mean(r["continued_tokens"] for r in recs),
            "on_decode": sum(r["continued_on"] == "decode" for r in recs),
            "on_prefill": sum(r["continued_on"] == "prefill" for r in recs),
            "ttft_p50_ms": percentile(t, 50) * 1000,
            "ttft_p99_ms": percentile(t, 99) * 1000,
            "realized_ratio": statistics.mean(r["ratio"] for r in recs),
        }
    cold = out["cold"]["ttft_p50_ms"]
    out["speedup_p50"] = {label: cold / out[label]["ttft_p50_ms"] for label in CONDITIONS[1:]}
    return out


def measure_mixed(gateway, stub, convs: list, budget: float, concurrency: int, route_by_prefix: bool) -> dict:
    """Every conversation's three turns in order, ``concurrency`` conversations at a time (a new one starts
    as one ends): the follow-ups' prompt tokens served from a prefix cache."""
    from concurrent.futures import ThreadPoolExecutor

    router = gateway.servicer.router
    router.prefixes = PrefixIndex() if route_by_prefix else PrefixIndex(capacity=0)

    def talk(conv) -> list[dict]:
        return [_call(stub, _request(conv[: 2 * turn + 1], budget)) for turn in range(3)]

    with ThreadPoolExecutor(concurrency) as pool:
        turns = list(pool.map(talk, convs))
    follows = [r for conv in turns for r in conv[1:]]
    return {
        "requests": 3 * len(convs),
        "concurrency": concurrency,
        "follow_ups": len(follows),
        "follow_ups_hit": sum(2 * r["cached_tokens"] >= r["prompt_tokens"] for r in follows) / len(follows),
        "token_hit_rate": sum(r["cached_tokens"] for r in follows) / sum(r["prompt_tokens"] for r in follows),
    }


def table(ttft: dict, mixed: dict) -> str:
    lines = ["| history | follow-up | prompt tokens | cached positions | appended | continued on decode / prefill | "
             "TTFT p50 ms | TTFT p99 ms | realized ratio |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for length, res in ttft.items():
        for label in CONDITIONS:
            r = res[label]
            lines.append(
                f"| {length} | {label} | {r['prompt_tokens']:.0f} | {r['cached_tokens']:.0f} | "
                f"{r['continued_tokens']:.0f} | {r['on_decode']} / {r['on_prefill']} of {r['n']} | "
                f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['realized_ratio']:.3f} |"
            )
        ups = ", ".join(f"{label} {x:.2f}x" for label, x in res["speedup_p50"].items())
        lines.append(f"| {length} | p50 speed-up over cold | {ups} | | | | | | |")
    lines += ["", "| routing (2 prefill workers) | requests | at once | follow-ups with half or more cached | "
              "follow-up tokens cached | evictions |", "|---|---|---|---|---|---|"]  # fmt: skip
    for label, r in mixed.items():
        lines.append(
            f"| {label} | {r['requests']} | {r['concurrency']} | {r['follow_ups_hit']:.0%} | "
            f"{r['token_hit_rate']:.0%} | {r['evictions']} |"
        )
    return "\n".join(lines)


def plot(ttft: dict, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = list(ttft)
    width = 0.2
    for j, label in enumerate(CONDITIONS):
        xs = [i + width * j for i in range(len(lengths))]
        p50 = [ttft[n][label]["ttft_p50_ms"] for n in lengths]
        p99 = [ttft[n][label]["ttft_p99_ms"] for n in lengths]
        ax.bar(xs, p50, width=width, label=f"{label} p50")
        ax.plot(xs, p99, "k_", markersize=18)
    ax.set_xticks([i + 1.5 * width for i in range(len(lengths))], [f"{n} history" for n in lengths])
    ax.set(ylabel="follow-up TTFT, ms (bars p50, ticks p99)", title="follow-up TTFT by path")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "prefix_ttft.png", dpi=120)
    plt.close(fig)
    return out / "prefix_ttft.png"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-lengths", default="1024,2048", help="prefix-ttft: history lengths in tokens")
    p.add_argument("--prefix-n", type=int, default=8, help="prefix-ttft: conversations per length")
    p.add_argument("--prefix-budget", type=float, default=0.1, help="prefix-ttft: the requests' budget")
    p.add_argument("--mixed-n", type=int, default=12, help="prefix-ttft: conversations of the mixed load")
    p.add_argument(
        "--mixed-cache-mb",
        type=int,
        default=0,
        help="prefix-ttft: each worker's cache in the mixed load (0: 4 conversations)",
    )
    p.add_argument("--mixed-concurrency", type=int, default=3, help="prefix-ttft: conversations at once")
    p.add_argument("--prefix-threads", type=int, default=2, help="prefix-ttft: torch threads")


def main(args) -> int:
    import torch

    from vlkv_lab.eval.zoo_text import load_text_model

    torch.set_num_threads(args.prefix_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor = load_text_model()
    lengths = [int(x) for x in args.prefix_lengths.split(",")]
    if getattr(args, "quick", False):  # a smoke run: one short history, a few conversations
        lengths, args.prefix_n, args.mixed_n = [512], 2, 4
    t0 = time.perf_counter()
    cfg = ServerConfig(model=ModelConfig(path=model.name_or_path), image_cache_mb=0)
    gateway, _, stop = _serve(cfg, model, processor)
    try:
        stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway.address))
        _call(
            stub, _request(conversations(processor.tokenizer, 512, 1, 99)[0][:1], args.prefix_budget)
        )  # warm
        ttft = {}
        for length in lengths:
            convs = conversations(processor.tokenizer, length, args.prefix_n, seed=length)
            ttft[f"{length // 1024}K" if length % 1024 == 0 else str(length)] = measure_ttft(
                gateway, stub, convs, args.prefix_budget
            )
            print(f"  {length}: {json.dumps(ttft[list(ttft)[-1]], default=float)}", flush=True)
    finally:
        stop()
    convs = conversations(processor.tokenizer, 1024, args.mixed_n, seed=7)
    spec_bytes = 2 * model.config.text_config.num_hidden_layers * model.config.text_config.num_key_value_heads
    spec_bytes *= model.config.text_config.head_dim * model.dtype.itemsize
    mb = args.mixed_cache_mb or max(1, (4 * 1400 * spec_bytes) >> 20)  # about four conversations' prompts
    mixed = {}
    for route in (True, False):
        cfg = ServerConfig(model=ModelConfig(path=model.name_or_path), image_cache_mb=0, prefix_cache_mb=mb)
        gateway, workers, stop = _serve(cfg, model, processor, prefills=2)
        try:
            stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway.address))
            label = "by prefix" if route else "least-loaded (prefix index off)"
            mixed[label] = measure_mixed(
                gateway, stub, convs, args.prefix_budget, args.mixed_concurrency, route
            )
            mixed[label]["evictions"] = sum(w.servicer.prefix_cache.stats().evictions for w in workers)
            mixed[label]["cache_mb_per_worker"] = mb
        finally:
            stop()
    meta = dict(model="SmolLM2-135M-Instruct (text-only LLaVA wrapper)", dtype=str(model.dtype), threads=args.prefix_threads,
                n=args.prefix_n, budget=args.prefix_budget, policy="vlcache", wall_s=round(time.perf_counter() - t0, 1))  # fmt: skip
    md = f"Follow-up TTFT and prefix-cache hit rate ({meta})\n\n{table(ttft, mixed)}"
    (out / "prefix_ttft.md").write_text(md + "\n")
    (out / "prefix_ttft.json").write_text(json.dumps(dict(meta=meta, ttft=ttft, mixed=mixed), indent=1))
    path = plot(ttft, out)
    print(md + f"\n\nplot: {path or 'not drawn (matplotlib not installed)'}; report and results in {out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/bench_prefix_ttft")
    parser.add_argument("--quick", action="store_true", help="one 512-token history, a few conversations")
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
