"""Drafts of several prompts stepped as one batch are each prompt's own draft, and a prefill worker that runs
requests at once batches the drafts that wait together."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.prefill_worker import draft_batch
from vlkv.prefill_worker.draft_batch import DraftBatcher
from vlkv.prefill_worker.draft_queries import run_draft, run_drafts

QUESTIONS = (
    "what colour is the square ?",
    "what colour is the square circle triangle red blue ? " * 3,
    "red ?",
)


@pytest.fixture(scope="module")
def prompts(tiny_model_dirs):
    cfg = ModelConfig(path=tiny_model_dirs("llava-gqa"))
    engine = InProcessEngine(load_model(cfg), load_processor(cfg.path))
    out = []
    for i, q in enumerate(QUESTIONS):
        logits, keys, values = engine.prefill.forward(engine.prepare([random_png(i)], question=q))
        out.append((keys, values, int(logits.argmax()), 12 - 3 * i))
    return engine, out


def _same(a, b) -> None:
    assert (a.m, a.inputs, a.tokens) == (b.m, b.inputs, b.tokens)
    for x, y in zip(a.queries + a.keys, b.queries + b.keys, strict=True):
        assert x.shape == y.shape and torch.allclose(x, y, atol=1e-5)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_a_batch_of_drafts_is_each_prompts_own_draft(prompts):
    engine, items = prompts
    eos = engine.spec.eos_token_ids
    eos_first = (items[0][0], items[0][1], eos[0], 8)  # an end token first: no step at all
    alone = [run_draft(engine.model, k, v, f, s, eos, logprobs=True) for k, v, f, s in [*items, eos_first]]
    together = run_drafts(engine.model, [*items, eos_first], eos, logprobs=True)
    for a, b in zip(alone[:-1], together[:-1], strict=True):
        _same(a, b)
    assert together[-1].rows == 0 and alone[-1].rows == 0
    assert [d.rows for d in together[:-1]] == [12, 9, 6]


def test_the_batcher_drafts_what_waits_as_one_batch(prompts, monkeypatch):
    engine, items = prompts
    sizes, gate = [], threading.Event()
    real = draft_batch.run_drafts

    def recording(model, batch, eos, logprobs=False):
        sizes.append(len(batch))
        gate.wait(10)  # the first batch runs until the others have queued behind it
        return real(model, batch, eos, logprobs)

    monkeypatch.setattr(draft_batch, "run_drafts", recording)
    batcher = DraftBatcher(engine.model, engine.spec.eos_token_ids, max_batch=4)
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(batcher.draft, *items[0])
            while not sizes:
                time.sleep(0.001)
            rest = [pool.submit(batcher.draft, *item) for item in items[1:]]
            while batcher._queue.qsize() < 2:
                time.sleep(0.001)
            gate.set()
            drafts = [first.result(30)] + [f.result(30) for f in rest]
    finally:
        batcher.close()
    assert sizes == [1, 2] and batcher.batches == 2 and batcher.drafted == 3
    eos = engine.spec.eos_token_ids
    for (k, v, f, s), d in zip(items, drafts, strict=True):
        _same(run_draft(engine.model, k, v, f, s, eos, logprobs=True), d)


def test_a_prefill_worker_running_requests_at_once_answers_as_one_at_a_time(tiny_model_dirs):
    """--prefill-concurrency 3: three verified requests at once get what each gets alone."""
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=8 << 20),
        prefill_concurrency=3,
    )
    cluster = InProcCluster(cfg)
    try:
        reqs = [
            build_request(images=[random_png(i)], question=q, max_new_tokens=6)
            for i, q in enumerate(QUESTIONS)
        ]
        alone = [generate(cluster.stub, r, timeout=60) for r in reqs]
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda r: generate(cluster.stub, r, timeout=60), reqs))
        for a, b in zip(alone, together, strict=True):
            assert a.token_ids == b.token_ids
            assert a.finished.usage.verified_candidate == b.finished.usage.verified_candidate != ""
            assert a.finished.usage.verified_agreement == pytest.approx(b.finished.usage.verified_agreement)
        drafts = cluster.prefill.servicer.engine.drafts
        assert drafts is not None and drafts.drafted == 6 and drafts.batches <= 6
    finally:
        cluster.close()
