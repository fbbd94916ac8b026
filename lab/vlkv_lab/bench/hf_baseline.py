"""The baseline a user would run instead of vlkv: a plain Hugging Face ``generate()`` server.

It speaks vlkv's public API (``vlkv.v1.Generation/Generate``, same request validation, same statuses) but
serves the way a simple colocated server does: one process, one model, the full KV cache, static
batches. Requests that arrive within ``collect_ms`` of each other are batched (prompts padded on the
left; the batch closes once no request arrived for ``collect_ms``, or after 25 such windows) and run through ``model.generate`` together; the next batch starts when the current one ends.

Tokens are streamed as they are generated: a ``transformers`` streamer receives each step's tokens for the
whole batch and forwards every row's token to its caller (a row's stream ends at its own eos, stop string
or ``max_new_tokens``; a stopping criterion ends the batch once every row has ended).

KV memory: the same budget as vlkv's decode pool, expressed as a cap on the sequences in a batch: a batch
of n rows padded to prompt length M with up to N new tokens holds ``n * (M + N) * bytes_per_token`` of
full KV cache (all layers, K and V), which must stay within ``kv_budget_bytes``. A request that cannot fit
even alone, or that finds the queue full, is refused with RESOURCE_EXHAUSTED.

    python -m vlkv_lab.bench.hf_baseline --port 50061 --kv-budget-mb 32 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from vlkv.common.config import DEFAULT_MODEL_DIR, Limits, ModelConfig
from vlkv.common.errors import InvalidInput, ResourceExhausted, VlkvError
from vlkv.common.grpc_server import Server, abort_stream_on_error
from vlkv.common.model.inputs import decode_images, prepare_inputs
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import render_prompt, sampling_from_proto
from vlkv.common.sampling import SamplingConfig
from vlkv.v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)

LENGTH = generate_pb2.FINISH_REASON_LENGTH
EOS = generate_pb2.FINISH_REASON_EOS
STOP = generate_pb2.FINISH_REASON_STOP_STRING


@dataclass(eq=False)
class _Pending:
    """One request waiting for, or running in, a batch."""

    images: list
    prompt: str
    m: int
    vision_tokens: int
    sampling: SamplingConfig
    loop: asyncio.AbstractEventLoop
    arrived: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False
    cancelled: bool = False
    first_token_at: float | None = None

    @property
    def key(self) -> tuple:
        s = self.sampling
        return (s.temperature, s.top_p, s.top_k)

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class _BatchStreamer(BaseStreamer):
    """Receives each generation step's tokens ``[B]`` and forwards them to the batch's rows."""

    def __init__(self, rows: list[_Pending], tokenizer, eos: set[int]) -> None:
        self.rows = rows
        self.tokenizer = tokenizer
        self.eos = eos
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt ids
            self._prompt_seen = True
            return
        tokens = value.reshape(len(self.rows), -1)[:, -1].tolist()
        now = time.perf_counter()
        for row, tok in zip(self.rows, tokens, strict=True):
            if row.done:
                continue
            if row.cancelled:
                row.done = True
                continue
            if tok in self.eos:
                row.done = True
                row.emit("finished", EOS)
                continue
            row.ids.append(tok)
            text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
            delta, row.text = text[len(row.text) :], text
            if row.first_token_at is None:
                row.first_token_at = now
            reason = None
            if any(s in row.text for s in row.sampling.stop):
                reason = STOP
            elif len(row.ids) >= row.sampling.max_new_tokens:
                reason = LENGTH
            row.emit("token", tok, delta)
            if reason is not None:
                row.done = True
                row.emit("finished", reason)

    def end(self) -> None:
        for row in self.rows:
            if not row.done:
                row.done = True
                row.emit("finished", LENGTH)


class _AllRowsDone(StoppingCriteria):
    def __init__(self, rows: list[_Pending]) -> None:
        self.rows = rows

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.tensor([r.done or r.cancelled for r in self.rows], dtype=torch.bool)


class HFBaselineServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        model,
        processor,
        *,
        kv_budget_bytes: int,
        max_batch: int = 256,
        collect_ms: float = 5.0,
        max_waiting: int = 256,
        limits: Limits | None = None,
    ) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.limits = limits or Limits()
        spec = ModelSpec.from_model(model, self.tokenizer)
        self.spec = spec
        self.bytes_per_token = spec.bytes_per_token_layer * spec.num_layers
        self.kv_budget_bytes = kv_budget_bytes
        self.max_batch = max_batch
        self.collect_s = collect_ms / 1000
        self.max_waiting = max_waiting
        self.image_token_id = spec.image_token_id
        self.context = spec.context
        self.eos = set(spec.eos_token_ids)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = next(iter(self.eos), 0)
        self.waiting: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self.stats = {"batches": 0, "sequences": 0, "max_batch_seen": 0, "refused": 0, "batch_sizes": []}

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._batcher())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for p in self.waiting:
            p.emit("error", VlkvError("server shutting down", grpc.StatusCode.UNAVAILABLE))
        self.waiting.clear()
        self._executor.shutdown(wait=True)

    def kv_bytes(self, rows: int, prompt_len: int, new_tokens: int) -> int:
        """Full KV bytes of a padded batch."""
        return rows * (prompt_len + new_tokens) * self.bytes_per_token

    @property
    def max_sequences(self) -> int:
        """How many sequences of the given shape the budget holds (for reports)."""
        return self.kv_budget_bytes // self.bytes_per_token

    # -- the API -------------------------------------------------------------------------------------
    def _validate(self, request) -> _Pending:
        sampling = sampling_from_proto(request.sampling, self.limits)
        prompt = render_prompt(request, self.processor)
        images = decode_images(list(request.images), self.limits)
        modality = prepare_inputs(self.processor, images, prompt, self.image_token_id).modality
        m = modality.m
        if m + sampling.max_new_tokens > self.context:
            raise InvalidInput(
                f"prompt ({m} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the model's "
                f"context of {self.context} tokens"
            )
        if self.kv_bytes(1, m, sampling.max_new_tokens) > self.kv_budget_bytes:
            raise ResourceExhausted(
                f"the request needs {self.kv_bytes(1, m, sampling.max_new_tokens)} bytes of KV cache, over "
                f"the budget of {self.kv_budget_bytes}"
            )
        if len(self.waiting) >= self.max_waiting:
            raise ResourceExhausted(f"the queue is full ({self.max_waiting} requests waiting)")
        return _Pending(
            images=images,
            prompt=prompt,
            m=m,
            vision_tokens=modality.num_vision_tokens,
            sampling=sampling,
            loop=asyncio.get_running_loop(),
            arrived=time.perf_counter(),
        )

    @abort_stream_on_error
    async def Generate(self, request, context):
        try:
            p = self._validate(request)
        except ResourceExhausted:
            self.stats["refused"] += 1
            raise
        self.waiting.append(p)
        self._wake.set()
        try:
            while True:
                kind, *rest = await p.events.get()
                if kind == "token":
                    tok, delta = rest
                    yield generate_pb2.GenerateResponse(
                        request_id=request.request_id,
                        token=generate_pb2.TokenChunk(token_ids=[tok], text=delta),
                    )
                elif kind == "finished":
                    full = self.kv_bytes(1, p.m, len(p.ids))
                    usage = generate_pb2.Usage(
                        prompt_tokens=p.m,
                        vision_tokens=p.vision_tokens,
                        generated_tokens=len(p.ids),
                        kv_bytes_kept=full,
                        kv_bytes_full=full,
                        compression_ratio=1.0,
                        ttft_ms=((p.first_token_at or time.perf_counter()) - p.arrived) * 1000,
                        policy="hf-full",
                    )
                    yield generate_pb2.GenerateResponse(
                        request_id=request.request_id,
                        finished=generate_pb2.Finished(reason=rest[0], usage=usage),
                    )
                    return
                else:
                    raise rest[0]
        finally:
            p.cancelled = True
            if p in self.waiting:
                self.waiting.remove(p)

    # -- batching ------------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Pending]:
        """FIFO: the head request and the next ones with the same sampling mode, while the KV fits."""
        head = self.waiting[0]
        batch, longest, most_new = [], 0, 0
        for p in list(self.waiting):
            if p.key != head.key or len(batch) >= self.max_batch:
                continue
            m, n = max(longest, p.m), max(most_new, p.sampling.max_new_tokens)
            if batch and self.kv_bytes(len(batch) + 1, m, n) > self.kv_budget_bytes:
                break
            batch.append(p)
            longest, most_new = m, n
        for p in batch:
            self.waiting.remove(p)
        return batch

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            # let a burst join this batch: wait while requests keep arriving (at most 25 windows)
            t0 = loop.time()
            while True:
                before = len(self.waiting)
                await asyncio.sleep(self.collect_s)
                if len(self.waiting) == before or loop.time() - t0 > 25 * self.collect_s:
                    break
            self.waiting = [p for p in self.waiting if not p.cancelled]
            if not self.waiting:
                continue
            batch = self._take_batch()
            self.stats["batches"] += 1
            self.stats["sequences"] += len(batch)
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(batch))
            self.stats["batch_sizes"].append(len(batch))
            try:
                await loop.run_in_executor(self._executor, self._run_batch, batch)
            except Exception as exc:  # a failed batch fails its requests, not the server
                log.exception("batch of %d failed", len(batch))
                for p in batch:
                    if not p.done:
                        p.done = True
                        p.emit("error", VlkvError(f"generation failed: {exc}", grpc.StatusCode.INTERNAL))

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Pending]) -> None:
        self.tokenizer.padding_side = "left"
        images = [im for p in batch for im in p.images]
        inputs = self.processor(
            images=images or None, text=[p.prompt for p in batch], padding=True, return_tensors="pt"
        ).to(self.model.device)
        s = batch[0].sampling
        kw = (
            dict(do_sample=False)
            if s.greedy
            else dict(do_sample=True, temperature=s.temperature, top_p=s.top_p)
        )
        if not s.greedy and s.top_k:
            kw["top_k"] = s.top_k
        self.model.generate(
            **inputs,
            max_new_tokens=max(p.sampling.max_new_tokens for p in batch),
            eos_token_id=sorted(self.eos) or None,
            pad_token_id=self.pad_id,
            streamer=_BatchStreamer(batch, self.tokenizer, self.eos),
            stopping_criteria=StoppingCriteriaList([_AllRowsDone(batch)]),
            **kw,
        )


@dataclass
class RunningBaseline:
    server: Server
    servicer: HFBaselineServicer

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace: float = 2.0) -> None:
        await self.server.stop(grace)
        await self.servicer.stop()


async def start_hf_baseline(
    model_path: str,
    *,
    kv_budget_bytes: int,
    host: str = "127.0.0.1",
    port: int = 0,
    threads: int = 2,
    max_batch: int = 256,
    collect_ms: float = 5.0,
    model=None,
    processor=None,
) -> RunningBaseline:
    torch.set_num_threads(threads)
    cfg = ModelConfig(path=model_path, torch_threads=threads)
    model = model if model is not None else load_model(cfg)
    processor = processor if processor is not None else load_processor(model_path)
    servicer = HFBaselineServicer(
        model, processor, kv_budget_bytes=kv_budget_bytes, max_batch=max_batch, collect_ms=collect_ms
    )
    name = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server = Server(host, port, [name], Limits().max_message_bytes)
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server.server)
    await servicer.start()
    await server.start()
    return RunningBaseline(server, servicer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vlkv_lab.bench.hf_baseline", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument(
        "--kv-budget-mb", type=float, default=256, help="KV memory for all running sequences (MiB)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--collect-ms", type=float, default=5.0, help="how long a batch waits for more requests")
    p.add_argument("--stats-file", default=None, help="write batching statistics here on exit (JSON)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve() -> None:
        running = await start_hf_baseline(
            args.model,
            kv_budget_bytes=int(args.kv_budget_mb * (1 << 20)),
            host=args.host,
            port=args.port,
            threads=args.threads,
            max_batch=args.max_batch,
            collect_ms=args.collect_ms,
        )
        print(f"hf baseline listening on {running.address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await running.stop()
        if args.stats_file:
            Path(args.stats_file).write_text(json.dumps(running.servicer.stats))

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
