"""A load generator for the public gRPC API (``vlkv.v1.Generation/Generate``).

It drives any server of that API (the vlkv gateway, the Hugging Face baseline of ``hf_baseline.py``) with
requests from the synthetic task or from a directory of images and prompts, either

- closed-loop: ``concurrency`` streams, each sending its next request when the previous one ends, or
- open-loop: Poisson arrivals at ``rate`` requests per second, whatever the server's state,

bounded by a request count and a wall-clock duration. Per request it records the time to first token,
the inter-token latencies, the end-to-end latency, the tokens received and the final gRPC status; a
progress line goes to stderr. Everything runs on one ``grpc.aio`` channel in one event loop.

    python -m vlkv_lab.loadgen --address 127.0.0.1:50051 --concurrency 8 -n 64
    python -m vlkv_lab.loadgen --address 127.0.0.1:50051 --rate 2 --duration 60 --dir my_images/

``--http URL`` (``http://127.0.0.1:8000/v1``) sends the same requests through the OpenAI-compatible HTTP front
instead, with the ``openai`` client (``lab/vlkv_lab/openai_stub.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from vlkv.deploy.client import png_bytes
from vlkv.deploy.progress import Progress
from vlkv.v1 import generate_pb2, generate_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20
FILLER_WORDS = "the square is red . the circle is blue . there are two shapes . a triangle is green .".split()


# ---------------------------------------------------------------------------------------------------------
# Workloads: lists of GenerateRequest, cycled by the generator.


def _request(
    images: list[bytes],
    content: list[tuple[str, str]],
    *,
    max_new_tokens: int,
    policy: str,
    budget: float | None,
    temperature: float | None = None,
) -> generate_pb2.GenerateRequest:
    """A one-turn chat request; ``content`` is a list of ("text", str) and ("image", "") parts."""
    sampling = generate_pb2.SamplingParams(max_new_tokens=max_new_tokens)
    if temperature is not None:
        sampling.temperature = temperature
    compression = generate_pb2.CompressionParams(policy=policy)
    if budget is not None:
        compression.budget = budget
    parts = []
    for kind, text in content:
        if kind == "image":
            parts.append(generate_pb2.ContentPart(image=generate_pb2.ImagePlaceholder()))
        else:
            parts.append(generate_pb2.ContentPart(text=text))
    req = generate_pb2.GenerateRequest(images=images, sampling=sampling, compression=compression)
    req.chat.messages.append(generate_pb2.ChatMessage(role="user", content=parts))
    return req


def filler_text(num_words: int, seed: int = 0) -> str:
    """``num_words`` words of task-vocabulary sentences: a long text context that the tokenizer knows."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < num_words:
        start = rng.randrange(0, len(FILLER_WORDS), 4)
        out.extend(FILLER_WORDS[start : start + 4])
    return " ".join(out[:num_words])


def synthetic_workload(
    n: int,
    *,
    seed: int = 0,
    split: str = "heldout",
    images_per_prompt: int = 0,
    filler_words: int = 0,
    max_new_tokens: int = 16,
    policy: str = "",
    budget: float | None = None,
) -> list[generate_pb2.GenerateRequest]:
    """``n`` requests from the synthetic task (``vlkv.deploy.synthetic_task``).

    By default each request is one example: its image(s) then its question. ``images_per_prompt`` > 0 pads
    (or cuts) every prompt's images to that many, taking the extra ones from other examples, and
    ``filler_words`` > 0 puts that many words of text context before the images: both make long prompts
    (the question stays last, after the images, as in the paper's setting).
    """
    from vlkv.deploy.synthetic_task import make_examples

    examples = make_examples(max(n, 1) * (1 + images_per_prompt), seed=seed, split=split)
    spare = [im for ex in examples[n:] for im in ex.images]
    out = []
    for i, ex in enumerate(examples[:n]):
        images = list(ex.images)
        if images_per_prompt:
            while len(images) < images_per_prompt:
                images.append(spare.pop() if spare else ex.images[0])
            images = images[:images_per_prompt]
        content: list[tuple[str, str]] = []
        if filler_words:
            content.append(("text", filler_text(filler_words, seed=seed * 100003 + i) + " ."))
        content += [("image", "")] * len(images)
        content.append(("text", ex.question))
        out.append(
            _request(
                [png_bytes(im) for im in images],
                content,
                max_new_tokens=max_new_tokens,
                policy=policy,
                budget=budget,
            )
        )
    return out


def dir_workload(
    path: str | Path,
    *,
    n: int | None = None,
    max_new_tokens: int = 16,
    policy: str = "",
    budget: float | None = None,
) -> list[generate_pb2.GenerateRequest]:
    """Requests from a directory of ``*.png`` / ``*.jpg`` images and a ``prompts.txt`` (one prompt a line).

    Prompt i (cycled) takes the next images in sorted file order (cycled): as many as it has ``<image>``
    placeholders, sent as a plain-text prompt; a prompt without placeholders gets one image and is sent
    as a chat turn (the image, then the prompt). Blank lines and lines starting with ``#`` are skipped.
    """
    root = Path(path)
    files = sorted(p for p in root.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    prompts_file = root / "prompts.txt"
    if not prompts_file.is_file():
        raise FileNotFoundError(f"{prompts_file} is missing (one prompt per line)")
    prompts = [
        ln.strip() for ln in prompts_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    if not prompts:
        raise ValueError(f"{prompts_file} has no prompts")
    blobs = [p.read_bytes() for p in files]
    n = n or max(len(prompts), len(blobs))
    out, next_image = [], 0

    def take(k: int) -> list[bytes]:
        nonlocal next_image
        if k and not blobs:
            raise ValueError(f"prompts need images but {root} has no *.png or *.jpg files")
        got = [blobs[(next_image + j) % len(blobs)] for j in range(k)]
        next_image += k
        return got

    for i in range(n):
        prompt = prompts[i % len(prompts)]
        k = prompt.count("<image>")
        if k:
            req = _request(take(k), [], max_new_tokens=max_new_tokens, policy=policy, budget=budget)
            req.ClearField("chat")
            req.text = prompt
        else:
            images = take(1) if blobs else []
            content = [("image", "")] * len(images) + [("text", prompt)]
            req = _request(images, content, max_new_tokens=max_new_tokens, policy=policy, budget=budget)
        out.append(req)
    return out


# ---------------------------------------------------------------------------------------------------------
# Records and summaries.


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, ``start`` from the start of the run."""

    index: int
    start: float
    status: str = "OK"  # gRPC status code name
    error: str = ""
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between token messages after the first
    tokens: int = 0  # token ids received
    finish_reason: str = ""
    prompt_tokens: int = 0
    vision_tokens: int = 0
    generated_tokens: int = 0  # as the server's usage reports it
    compression_ratio: float = 0.0
    kv_bytes_kept: int = 0
    kv_bytes_full: int = 0
    server_ttft_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "OK"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class LoadResult:
    records: list[RequestRecord]
    wall_s: float
    mode: str
    concurrency: int = 0
    rate: float = 0.0
    started_unix: float = 0.0  # wall-clock time of the run's start (records' ``start`` count from it)

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    def errors(self) -> dict[str, int]:
        return dict(Counter(r.status for r in self.records if not r.ok))

    def summary(self) -> dict:
        ok = self.ok
        tokens = sum(r.tokens for r in ok)
        ttft = [r.ttft for r in ok if r.ttft is not None]
        itl = [x for r in ok for x in r.itl]
        e2e = [r.e2e for r in ok]
        # decode throughput: tokens after each request's first, over the span in which they arrived
        decode_tokens = sum(max(0, r.tokens - 1) for r in ok)
        spans = [(r.start + r.ttft, r.start + r.e2e) for r in ok if r.ttft is not None and r.tokens > 1]
        decode_span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
        return {
            "mode": self.mode,
            "started_unix": self.started_unix,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "requests": len(self.records),
            "ok": len(ok),
            "errors": self.errors(),
            "error_details": {r.status: r.error for r in reversed(self.records) if not r.ok},
            "wall_s": self.wall_s,
            "tokens": tokens,
            "throughput_tok_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "requests_per_s": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "decode_tok_s": decode_tokens / decode_span if decode_span > 0 else 0.0,
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else math.nan,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50),
            "itl_p90_s": percentile(itl, 90),
            "itl_p99_s": percentile(itl, 99),
            "e2e_mean_s": sum(e2e) / len(e2e) if e2e else math.nan,
            "e2e_p50_s": percentile(e2e, 50),
            "e2e_p90_s": percentile(e2e, 90),
            "e2e_p99_s": percentile(e2e, 99),
            "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / len(ok) if ok else 0.0,
            "compression_ratio_mean": sum(r.compression_ratio for r in ok) / len(ok) if ok else 0.0,
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "records": [asdict(r) for r in self.records]}


# ---------------------------------------------------------------------------------------------------------
# The generator.


class _Progress:
    """Requests completed of the total (``deploy/progress.py``), with calls in flight, errors and tok/s."""

    def __init__(self, label: str, target: int | None, enabled: bool) -> None:
        self.sent = self.done = self.errors = self.tokens = 0
        self.t0 = time.perf_counter()
        self.bar = Progress(target, desc=label, unit="req", disable=not enabled)

    def tick(self) -> None:
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix(f"{self.sent - self.done} in flight, {self.errors} errors, {rate:.1f} tok/s")
        self.bar.update(self.done - self.bar.n)

    def close(self) -> None:
        self.tick()
        self.bar.close()


async def _one(
    stub, req, index: int, t0: float, timeout_s: float, progress: _Progress, metadata
) -> RequestRecord:
    rec = RequestRecord(index=index, start=time.perf_counter() - t0)
    begin = time.perf_counter()
    last = None
    progress.sent += 1
    try:
        call = stub.Generate(req, timeout=timeout_s, metadata=metadata)
        async for resp in call:
            now = time.perf_counter()
            if resp.HasField("token"):
                n = len(resp.token.token_ids)
                if rec.ttft is None:
                    rec.ttft = now - begin
                elif last is not None:
                    rec.itl.append(now - last)
                last = now
                rec.tokens += n
                progress.tokens += n
            elif resp.HasField("finished"):
                f = resp.finished
                u = f.usage
                rec.finish_reason = generate_pb2.FinishReason.Name(f.reason).removeprefix("FINISH_REASON_")
                rec.prompt_tokens = u.prompt_tokens
                rec.vision_tokens = u.vision_tokens
                rec.generated_tokens = u.generated_tokens
                rec.compression_ratio = u.compression_ratio
                rec.kv_bytes_kept = u.kv_bytes_kept
                rec.kv_bytes_full = u.kv_bytes_full
                rec.server_ttft_ms = u.ttft_ms
    except grpc.aio.AioRpcError as exc:
        rec.status = exc.code().name
        rec.error = exc.details() or ""
    except asyncio.CancelledError:
        rec.status = "CANCELLED"
        rec.error = "cancelled by the load generator at the end of the run"
    rec.e2e = time.perf_counter() - begin
    progress.done += 1
    progress.errors += not rec.ok
    progress.tick()
    return rec


async def run_load_async(
    address: str,
    requests: list[generate_pb2.GenerateRequest],
    *,
    concurrency: int = 0,
    rate: float = 0.0,
    max_requests: int | None = None,
    duration_s: float | None = None,
    timeout_s: float = 300.0,
    drain_s: float = 60.0,
    seed: int = 0,
    label: str = "loadgen",
    progress: bool = True,
    metadata: tuple = (),
    http: str = "",
) -> LoadResult:
    """Closed loop at ``concurrency`` (> 0) or open loop at ``rate`` requests/s (Poisson arrivals).

    Sends at most ``max_requests`` (default: ``len(requests)``; requests are cycled) and none after
    ``duration_s``; calls still running ``drain_s`` after the last send are cancelled (recorded as
    CANCELLED). Each call has a ``timeout_s`` deadline. ``http``: the base URL of an OpenAI-compatible
    HTTP front to send the requests to instead of the gRPC ``address``.
    """
    if not requests:
        raise ValueError("no requests to send")
    if (concurrency > 0) == (rate > 0):
        raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
    if max_requests is None and duration_s is None:
        max_requests = len(requests)
    limit = max_requests if max_requests is not None else math.inf
    prog = _Progress(label, max_requests, progress)
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    records: list[RequestRecord] = []
    async with _stub(address, options, http, metadata) as stub:
        t0, started_unix = time.perf_counter(), time.time()
        deadline = t0 + duration_s if duration_s is not None else math.inf
        issued = 0

        def next_index() -> int | None:
            nonlocal issued
            if issued >= limit or time.perf_counter() >= deadline:
                return None
            issued += 1
            return issued - 1

        async def worker() -> None:
            while (i := next_index()) is not None:
                records.append(
                    await _one(stub, requests[i % len(requests)], i, t0, timeout_s, prog, metadata)
                )

        tasks: list[asyncio.Task] = []
        if concurrency > 0:
            tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        else:
            rng = random.Random(seed)
            arrival = t0
            while True:
                arrival += rng.expovariate(rate)
                now = time.perf_counter()
                if arrival > now:
                    await asyncio.sleep(arrival - now)
                i = next_index()
                if i is None:
                    break

                async def single(i=i) -> None:
                    records.append(
                        await _one(stub, requests[i % len(requests)], i, t0, timeout_s, prog, metadata)
                    )

                tasks.append(asyncio.ensure_future(single()))
                prog.tick()

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.5)
                prog.tick()

        tick = asyncio.ensure_future(ticker())
        try:
            if tasks:
                # closed loop: workers stop sending at the deadline; allow drain_s for the last calls
                budget = None if deadline == math.inf else max(0.0, deadline - time.perf_counter()) + drain_s
                done, pending = await asyncio.wait(tasks, timeout=budget)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            tick.cancel()
            await asyncio.gather(tick, return_exceptions=True)
        wall = time.perf_counter() - t0
    prog.close()
    records.sort(key=lambda r: r.index)
    return LoadResult(records, wall, "closed" if concurrency > 0 else "open", concurrency, rate, started_unix)


@contextlib.asynccontextmanager
async def _stub(address: str, options: list, http: str, metadata: tuple):
    """The gRPC stub of ``address``, or with ``http`` the OpenAI-client stand-in for that HTTP front."""
    if http:
        from vlkv_lab.openai_stub import OpenAIGenerationStub

        token = dict(metadata).get("authorization", "").removeprefix("Bearer ")
        stub = OpenAIGenerationStub(http, token)
        try:
            yield stub
        finally:
            await stub.close()
        return
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        yield generate_pb2_grpc.GenerationStub(channel)


def run_load(address: str, requests: list, **kwargs) -> LoadResult:
    """Synchronous wrapper of :func:`run_load_async` (runs its own event loop)."""
    return asyncio.run(run_load_async(address, requests, **kwargs))


def format_summary(s: dict) -> str:
    errs = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "none"
    return (
        f"{s['ok']}/{s['requests']} ok (errors: {errs}) in {s['wall_s']:.1f} s | "
        f"{s['throughput_tok_s']:.1f} tok/s, {s['requests_per_s']:.2f} req/s, decode {s['decode_tok_s']:.1f} tok/s | "
        f"TTFT p50 {s['ttft_p50_s'] * 1000:.0f} ms p99 {s['ttft_p99_s'] * 1000:.0f} ms | "
        f"ITL p50 {s['itl_p50_s'] * 1000:.1f} ms p99 {s['itl_p99_s'] * 1000:.1f} ms | "
        f"e2e p50 {s['e2e_p50_s']:.2f} s p99 {s['e2e_p99_s']:.2f} s | prompt {s['prompt_tokens_mean']:.0f} tokens"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlkv_lab.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument(
        "--http", default="", help="OpenAI-compatible HTTP front to drive instead (http://HOST:PORT/v1)"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=0, help="closed loop: streams in flight")
    mode.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson arrivals per second")
    p.add_argument("-n", "--requests", type=int, default=None, help="requests to send (default 32)")
    p.add_argument("--duration", type=float, default=None, help="send no request after this many seconds")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each call (s)")
    p.add_argument("--dir", default=None, help="directory of *.png|*.jpg and prompts.txt")
    p.add_argument("--images-per-prompt", type=int, default=0, help="synthetic: images per prompt")
    p.add_argument("--filler-words", type=int, default=0, help="synthetic: words of text before the images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--policy", default="")
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--json", default=None, help="write the summary and every record to this file")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    if not args.concurrency and not args.rate:
        args.concurrency = 1
    n = args.requests or (None if args.duration else 32)
    pool = n or 256
    kw = dict(max_new_tokens=args.max_new_tokens, policy=args.policy, budget=args.budget)
    if args.dir:
        reqs = dir_workload(args.dir, n=pool, **kw)
    else:
        reqs = synthetic_workload(
            pool,
            seed=args.seed,
            images_per_prompt=args.images_per_prompt,
            filler_words=args.filler_words,
            **kw,
        )
    res = run_load(
        args.address,
        reqs,
        concurrency=args.concurrency,
        rate=args.rate,
        max_requests=n,
        duration_s=args.duration,
        timeout_s=args.timeout,
        seed=args.seed,
        progress=not args.quiet,
        http=args.http,
    )
    s = res.summary()
    print(format_summary(s))
    if args.json:
        Path(args.json).write_text(json.dumps(res.to_json(), indent=1))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
