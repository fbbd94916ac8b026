"""``vlkv eval --api``: the held-out accuracy measured through the public gRPC API.

``vlkv eval --table`` prefills each example once and compresses it per (policy, budget) in-process, which
is what makes a sweep of every policy over six budgets affordable on a CPU. This command checks that table
against the served system: it starts a gateway, a prefill worker and a decode worker (real gRPC over
localhost, in this process), asks every held-out question through the gateway at each requested
(policy, budget), scores the answers, and reports, per run, the accuracy and how many answers differ
from the in-process evaluation's answers for the same example.
"""

from __future__ import annotations

import asyncio
import io
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from vlkv.common.config import ModelConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.servers import start_decode_worker, start_gateway, start_prefill_worker
from vlkv.tools.client import build_request, generate
from vlkv.tools.eval.evaluation import evaluate, prepare
from vlkv.tools.progress import progress as track
from vlkv.tools.task.synthetic_task import is_correct, make_examples
from vlkv.v1 import generate_pb2_grpc


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


async def _serve(cfg: ServerConfig, model, processor):
    prefill = await start_prefill_worker(cfg, model=model, processor=processor)
    decode = await start_decode_worker(cfg, model=model, tokenizer=processor.tokenizer)
    gateway = await start_gateway(cfg, [prefill.address], [decode.address], processor=processor)
    return prefill, decode, gateway


def _ask_all(
    address: str, examples, policy: str, budget: float | None, max_new: int, workers: int
) -> list[str]:
    images = [[_png(im) for im in ex.images] for ex in examples]
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        def one(i: int) -> str:
            req = build_request(
                images=images[i],
                question=examples[i].question,
                max_new_tokens=max_new,
                policy=policy,
                budget=budget,
            )
            return generate(stub, req, 600).text

        with ThreadPoolExecutor(workers) as pool:
            label = f"api {policy}" + (f" {budget:.0%}" if budget is not None else "")
            return list(track(pool.map(one, range(len(examples))), total=len(examples), desc=label, unit="q"))


def run_api_check(args) -> int:
    runs = [("full", None)] + [(args.policy, float(b)) for b in args.budgets.split(",")]
    cfg = ServerConfig(model=ModelConfig(path=args.model))
    model = load_model(cfg.model)
    processor = load_processor(args.model)
    examples = make_examples(args.n, seed=args.seed, split=getattr(args, "split", "heldout"))
    prepared = prepare(model, processor, examples, progress=True)

    loop = asyncio.new_event_loop()
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = asyncio.run_coroutine_threadsafe(_serve(cfg, model, processor), loop).result(300)
    rows = []
    start = time.perf_counter()
    try:
        for policy, budget in runs:
            t0 = time.perf_counter()
            api = _ask_all(
                servers[2].address, examples, policy, budget, args.max_new_tokens, args.concurrency
            )
            local = evaluate(model, processor, prepared, policy, budget or 1.0, args.max_new_tokens).answers
            acc = sum(is_correct(t, ex) for t, ex in zip(api, examples, strict=True)) / len(examples)
            local_acc = sum(is_correct(t, ex) for t, ex in zip(local, examples, strict=True)) / len(examples)
            differ = sum(a.strip() != b.strip() for a, b in zip(api, local, strict=True))
            rows.append((policy, budget, acc, local_acc, differ, time.perf_counter() - t0))
            print(f"{policy} {budget}: api {acc:.3f} in-process {local_acc:.3f} differ {differ}", flush=True)
    finally:
        for s in servers[::-1]:
            asyncio.run_coroutine_threadsafe(s.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    full_acc = rows[0][2]
    md = [
        f"# Accuracy through the public gRPC API ({len(examples)} examples of split "
        f"{getattr(args, 'split', 'heldout')})",
        "",
        f"Command: `vlkv eval --api -n {args.n} --policy {args.policy} --budgets {args.budgets}`",
        "",
        "| run | accuracy (API) | relative to full (API) | accuracy (in-process eval) | answers that differ |",
        "| --- | --- | --- | --- | --- |",
    ]
    for policy, budget, acc, local_acc, differ, _ in rows:
        label = policy if budget is None else f"{policy} {budget:.0%}"
        rel = acc / full_acc if full_acc else 0.0
        md.append(f"| {label} | {acc:.3f} | {rel:.3f} | {local_acc:.3f} | {differ}/{len(examples)} |")
    md += ["", f"Wall time: {time.perf_counter() - start:.0f} s"]
    print("\n".join(md))
    if args.out:
        from pathlib import Path

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "api_check.md").write_text("\n".join(md) + "\n")
        print(f"wrote {out / 'api_check.md'}")
    return 0
