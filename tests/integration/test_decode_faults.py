"""One sequence's fault fails that sequence alone; the batch and the decode engine go on.

- sampling is numerically safe at every accepted setting (a tiny temperature used to overflow
  ``logits / T``: the prefill ended UNAVAILABLE, and a handed-over cache with it killed the decode loop);
- a cache header whose first token or EOS ids lie outside the vocabulary, or a cache holding NaN/inf, is
  refused with INVALID_ARGUMENT before it can join (and break) a running batch;
- non-finite logits or a sampling error in one sequence end that sequence only (``DecodeCore``);
- should the decode loop die anyway, the worker fails its streams with UNAVAILABLE, turns NOT_SERVING and
  calls its exit hook (``os._exit`` in production, so Ray and the autoscaler replace it).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from fake_runner import FakeRunner
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.errors import InvalidInput
from vlkv.common.grpc_server import make_sync_channel
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.wire import encode_compact_kv
from vlkv.common.sampling import NonFiniteLogits, SamplingConfig, make_generator, sample_token
from vlkv.decode_worker import core as core_module
from vlkv.decode_worker.block_manager import BlockManager
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.sequence import Sequence
from vlkv.decode_worker.server import ENGINE_DIED_EXIT_CODE
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.servers import start_decode_worker
from vlkv.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

Q = "what colour is the square ?"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=4 << 20, max_batch=8),
    )
    c = InProcCluster(cfg)
    c.decode_channel = make_sync_channel(c.decode.address, cfg.security)
    c.decode_stub = worker_pb2_grpc.DecodeWorkerStub(c.decode_channel)
    yield c
    c.decode_channel.close()
    c.close()


def _vocab(cluster) -> int:
    return cluster.decode.servicer.spec.vocab_size


def _chunks(servicer, rid, *, m=20, first=5, eos=(2,), max_new=4, poison=None, **sampling):
    """A hand-off stream for ``servicer``'s model; ``poison=(layer, tensor, value)`` plants one bad value."""
    layers, kv_heads, head_dim, dtype = servicer.layout
    g = torch.Generator().manual_seed(len(rid))
    lengths = [m] * layers
    keys = [torch.randn(kv_heads, n, head_dim, generator=g, dtype=dtype) for n in lengths]
    values = [torch.randn(kv_heads, n, head_dim, generator=g, dtype=dtype) for n in lengths]
    if poison is not None:
        layer, tensor, value = poison
        (keys if tensor == "keys" else values)[layer][0, m // 2, 1] = value
    return list(
        encode_compact_kv(
            CompactKV(keys, values, prompt_length=m, first_token=first),
            request_id=rid,
            fingerprint=servicer.fingerprint,
            sampling=generate_pb2.SamplingParams(max_new_tokens=max_new, seed=1, **sampling),
            eos_token_ids=list(eos),
            prompt_tokens=m,
            policy="full",
            chunk_bytes=4096,
        )
    )


def _decode(stub, rid, timeout=30.0):
    return list(stub.Decode(worker_pb2.DecodeRequest(request_id=rid, wait_ms=5000), timeout=timeout))


def _good_then_decode(cluster, rid: str) -> None:
    """The worker still serves: a fresh cache is taken and decoded to its end."""
    cluster.decode_stub.TransferKV(iter(_chunks(cluster.decode.servicer, rid)), timeout=30)
    msgs = _decode(cluster.decode_stub, rid)
    assert msgs[-1].HasField("finished") and msgs[0].token.token_ids == [5]


def _wait_free(cluster, free: int, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while cluster.pool.num_free != free and time.time() < deadline:
        time.sleep(0.01)
    assert cluster.pool.num_free == free


# -- sampling ----------------------------------------------------------------------------------------
EXTREME = {
    "temperature 1e-38": dict(temperature=1e-38),
    "temperature 1e-42": dict(temperature=1e-42),  # 1 / T overflows float32: every logit became +-inf
    "smallest float temperature": dict(temperature=1.4e-45),
    "double-only temperature": dict(temperature=5e-324),
    "temperature 1e-38, top_k 1": dict(temperature=1e-38, top_k=1),
    "temperature 100, top_p 1e-38": dict(temperature=100.0, top_p=1e-38),
    "temperature 100, top_k 1": dict(temperature=100.0, top_k=1),
    "temperature 100, top_k above vocab": dict(temperature=100.0, top_k=1_000_000),
    "temperature 3e-38, top_p 1e-7, top_k 2": dict(temperature=3e-38, top_p=1e-7, top_k=2),
}


@pytest.mark.parametrize("case", list(EXTREME))
def test_sample_token_is_safe_at_extreme_settings(case):
    g = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 30.0, 3e4):
        logits = torch.randn(97, generator=g) * scale
        logits[11] = float("-inf")  # masked entries stay allowed
        cfg = SamplingConfig(**EXTREME[case])
        token = sample_token(logits, cfg, make_generator(3))
        assert 0 <= token < 97 and token != 11
        if cfg.temperature < 1e-30 or cfg.top_k == 1 or cfg.top_p < 1e-30:
            assert token == int(torch.argmax(logits))  # the limit of a vanishing temperature


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_raise_a_clear_error(bad, temperature):
    logits = torch.randn(50)
    logits[7] = bad
    with pytest.raises(NonFiniteLogits, match="non-finite logits"):
        sample_token(logits, SamplingConfig(temperature=temperature), make_generator(0))
    with pytest.raises(NonFiniteLogits):
        sample_token(torch.full((4,), float("-inf")), SamplingConfig(temperature=temperature), None)


def test_settings_outside_the_accepted_range_are_invalid_input():
    for cfg in (SamplingConfig(temperature=-1.0), SamplingConfig(temperature=float("nan"))):
        with pytest.raises(InvalidInput):
            sample_token(torch.randn(8), cfg, None)


@pytest.mark.parametrize("case", list(EXTREME))
def test_extreme_sampling_through_the_public_api(cluster, case):
    """A valid answer or INVALID_ARGUMENT, never UNAVAILABLE; a plain request is answered afterwards."""
    req = build_request(images=[random_png(1)], question=Q, max_new_tokens=8, seed=5, **EXTREME[case])
    try:
        out = generate(cluster.stub, req, timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() == INVALID, (exc.code(), exc.details())
    else:
        assert out.finished is not None and 1 <= len(out.token_ids) <= 8
        assert all(0 <= t < _vocab(cluster) for t in out.token_ids)
    plain = generate(cluster.stub, build_request(images=[random_png(2)], question=Q, max_new_tokens=4), 30)
    assert plain.finished is not None


def test_tiny_temperature_in_a_handed_over_cache_decodes(cluster):
    """A cache carrying a tiny temperature used to kill the decode loop at its first sampled token."""
    free = cluster.pool.num_free
    chunks = _chunks(cluster.decode.servicer, "tiny-t", max_new=12, temperature=1e-42, top_p=0.5)
    cluster.decode_stub.TransferKV(iter(chunks), timeout=30)
    msgs = _decode(cluster.decode_stub, "tiny-t", timeout=20)
    assert msgs[-1].HasField("finished")
    assert all(t < _vocab(cluster) for m in msgs[:-1] for t in m.token.token_ids)
    _good_then_decode(cluster, "after-tiny-t")
    _wait_free(cluster, free)


# -- cache headers and contents ----------------------------------------------------------------------
class _Streams:
    """Good sequences decoding on the worker (each in its own thread) while a test sends a bad cache."""

    def __init__(self, cluster, prefix: str, n: int = 3, max_new: int = 400) -> None:
        self.results: dict[str, object] = {}
        self.started = [threading.Event() for _ in range(n)]
        self.threads = []
        servicer = cluster.decode.servicer
        for i in range(n):
            rid = f"{prefix}-{i}"
            cluster.decode_stub.TransferKV(iter(_chunks(servicer, rid, eos=(), max_new=max_new)), timeout=30)
            t = threading.Thread(target=self._run, args=(cluster.decode_stub, rid, self.started[i]))
            t.start()
            self.threads.append(t)
        for e in self.started:
            assert e.wait(20)

    def _run(self, stub, rid, started) -> None:
        msgs = []
        try:
            for msg in stub.Decode(worker_pb2.DecodeRequest(request_id=rid, wait_ms=5000), timeout=60):
                msgs.append(msg)
                started.set()
            self.results[rid] = msgs
        except grpc.RpcError as exc:
            self.results[rid] = exc
        finally:
            started.set()

    def assert_all_finished(self, max_new: int = 400) -> None:
        for t in self.threads:
            t.join(60)
        for rid, got in self.results.items():
            assert isinstance(got, list), f"{rid}: {got.code()} {got.details()}"
            assert got[-1].finished.reason == generate_pb2.FINISH_REASON_LENGTH
            assert sum(len(m.token.token_ids) for m in got[:-1]) == max_new


@pytest.mark.parametrize("field", ["first_token_id", "eos_token_ids"])
def test_out_of_vocabulary_ids_are_refused_and_others_finish(cluster, field):
    servicer, vocab, free = cluster.decode.servicer, _vocab(cluster), cluster.pool.num_free
    assert vocab > 0
    bad = {"first_token_id": dict(first=vocab), "eos_token_ids": dict(eos=(2, vocab + 7))}[field]
    streams = _Streams(cluster, f"beside-{field}")
    rid = f"oov-{field}"
    code = None
    try:
        cluster.decode_stub.TransferKV(iter(_chunks(servicer, rid, max_new=50, **bad)), timeout=30)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    if code is None:  # accepted: let it join the running batch, as a gateway's Decode call would
        try:
            _decode(cluster.decode_stub, rid, timeout=20)
        except grpc.RpcError:
            pass
    streams.assert_all_finished()
    assert code == INVALID, "a cache with an id outside the vocabulary was accepted"
    assert "outside the vocabulary" in details
    _wait_free(cluster, free)
    _good_then_decode(cluster, f"after-oov-{field}")


POISON = {
    "NaN in keys": (0, "keys", float("nan")),
    "inf in values": (1, "values", float("inf")),
    "-inf in keys": (2, "keys", float("-inf")),
}


@pytest.mark.parametrize("case", list(POISON))
def test_non_finite_cache_is_refused_and_worker_serves_on(cluster, case):
    servicer, free = cluster.decode.servicer, cluster.pool.num_free
    rid = f"poison-{case}"
    chunks = _chunks(servicer, rid, max_new=6, temperature=1.0, poison=POISON[case])
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub.TransferKV(iter(chunks), timeout=30)
    assert err.value.code() == INVALID and "NaN or inf" in err.value.details()
    assert cluster.pool.num_free == free and servicer.rendezvous.num_unclaimed == 0
    _good_then_decode(cluster, f"after-{case}")
    _wait_free(cluster, free)


def test_non_finite_logits_fail_only_their_sequence_on_the_server(cluster, monkeypatch):
    """The model's logits turn NaN for one sequence: that Decode call ends INVALID_ARGUMENT with the reason, the
    sequences decoding beside it finish, and the engine goes on."""
    servicer, free = cluster.decode.servicer, cluster.pool.num_free
    runner = servicer.engine.core.runner
    step = runner.step
    poisoned_from = 900  # positions only the poisoned sequence (prompt length 900) reaches

    def nan_for_one(batch):
        logits = step(batch).clone()  # an inference tensor otherwise
        for i, s in enumerate(batch):
            if s.position >= poisoned_from:
                logits[i, 3] = float("nan")
        return logits

    monkeypatch.setattr(runner, "step", nan_for_one)
    streams = _Streams(cluster, "beside-nan")
    chunks = _chunks(servicer, "nan-logits", m=poisoned_from, max_new=5, temperature=1.0)
    cluster.decode_stub.TransferKV(iter(chunks), timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        _decode(cluster.decode_stub, "nan-logits", timeout=20)
    assert err.value.code() == INVALID and "non-finite logits" in err.value.details()
    streams.assert_all_finished()
    monkeypatch.undo()
    _wait_free(cluster, free)
    _good_then_decode(cluster, "after-nan-logits")


# -- the core without a model ------------------------------------------------------------------------
def _core_with(n: int, temperature: float = 1.0):
    blocks, cache = BlockManager(64, 4), KVCache(64, 4, num_kv_heads=2, head_dim=3)
    core = DecodeCore(FakeRunner(cache), blocks, cache, max_batch=8)
    seqs = []
    for i in range(n):
        lengths = [6, 3]
        seq_blocks = blocks.allocate(lengths, 0)
        for table, k in zip(seq_blocks.tables, lengths, strict=True):
            cache.write(table, torch.ones(2, k, 3), torch.ones(2, k, 3))
        cfg = SamplingConfig(max_new_tokens=6, temperature=temperature, seed=i)
        seq = Sequence(f"r{i}", seq_blocks, lengths, 10 + i, i, cfg)
        core.add(seq)
        seqs.append(seq)
    return core, blocks, seqs


def _run_core(core, blocks):
    errors = {}
    while core.has_work:
        for seq in core.step().finished:
            if seq.error is not None:
                errors[seq.request_id] = seq.error
    assert blocks.num_free == blocks.num_blocks
    return errors


@pytest.mark.parametrize("fault", ["nan logits", "sampling raises"])
def test_a_fault_in_one_sequence_fails_only_it(monkeypatch, fault):
    core, blocks, seqs = _core_with(3)
    victim = seqs[1]
    if fault == "nan logits":
        step = core.runner.step

        def nan_for_victim(batch):
            logits = step(batch)
            for i, s in enumerate(batch):
                if s.tables is victim.blocks.tables and s.position == victim.prompt_length + 2:  # step 3
                    logits[i, 0] = float("nan")
            return logits

        monkeypatch.setattr(core.runner, "step", nan_for_victim)
    else:
        real = core_module.sample_tokens

        def raising(logits, cfgs, generators):  # one row's sampling raised: that row gets the error
            tokens = real(logits, cfgs, generators)
            return [
                RuntimeError("boom") if c is victim.sampling else t for c, t in zip(cfgs, tokens, strict=True)
            ]

        monkeypatch.setattr(core_module, "sample_tokens", raising)
    errors = _run_core(core, blocks)
    assert list(errors) == ["r1"]
    want, code = (
        ("non-finite logits", INVALID) if fault == "nan logits" else ("boom", grpc.StatusCode.INTERNAL)
    )
    assert want in errors["r1"].message and errors["r1"].code == code
    assert [len(s.generated) for s in seqs] == [6, 3 if fault == "nan logits" else 1, 6]


# -- the decode loop dies anyway -------------------------------------------------------------------
def test_engine_loop_death_turns_not_serving_and_exits(cluster):
    cfg, exits = cluster.cfg, []
    worker = cluster.run(start_decode_worker(cfg, model=cluster.model, tokenizer=cluster.processor.tokenizer))
    servicer = worker.servicer
    servicer.exit_process = exits.append
    channel = make_sync_channel(worker.address, cfg.security)
    stub, health = worker_pb2_grpc.DecodeWorkerStub(channel), health_pb2_grpc.HealthStub(channel)
    check = health_pb2.HealthCheckRequest(service="")
    try:
        assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        stub.TransferKV(iter(_chunks(servicer, "doomed", max_new=20)), timeout=30)

        def broken_schedule():
            raise RuntimeError("scheduler bug")

        servicer.engine.core.schedule = broken_schedule  # the loop calls it once the sequence arrives
        with pytest.raises(grpc.RpcError) as err:  # ends at once, not at its deadline
            _decode(stub, "doomed", timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "scheduler bug" in err.value.details()
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.02)
        assert exits == [ENGINE_DIED_EXIT_CODE]
        assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert stub.GetLoad(worker_pb2.LoadRequest(), timeout=10).draining
        with pytest.raises(grpc.RpcError) as err:
            stub.TransferKV(iter(_chunks(servicer, "after-death")), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert servicer.pool.num_free == servicer.pool.num_blocks
    finally:
        channel.close()
        cluster.run(worker.stop())
