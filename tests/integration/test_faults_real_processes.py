"""Faults on real processes: every server is its own OS process, killed or stopped with real signals.

Two prefill workers, one decode worker and the gateway each run in a child process (``tests.proc_server``).
The prefill workers pause ``CHUNK_DELAY_MS`` before each KV chunk after the header (the test-only knob
``TransferConfig.fault_chunk_delay_ms``), so a hand-off is visibly in flight once the decode worker has
reserved its blocks: that is when the tests SIGKILL the sending prefill worker or SIGSTOP the decode
worker. What happens after the signal is the product's own code path.

Scenarios (the failure policy in docs/operations.md "Scaling and failures"):
- more streams than the decode pool holds: the newest are preempted to host memory and resumed, every
  client gets its whole answer, the pool returns;
- gateway SIGKILLed with streams in flight: clients get UNAVAILABLE, the decode worker frees every
  sequence, a new gateway started on the same port and workers answers;
- decode worker stopped mid-hand-off: the sender's deadline ends the hand-off, the client gets
  UNAVAILABLE within a bounded time, the prefill worker keeps serving, the pool returns after SIGCONT;
- decode worker stopped mid-stream: the gateway's keepalive pings go unanswered, the client gets
  UNAVAILABLE (before keepalive, the call waited for ever), the pool returns after SIGCONT;
- prefill worker SIGKILLed mid-hand-off: the decode worker frees the partial cache and the gateway retries
  once on the other prefill worker (the client gets the normal answer); with no other prefill worker the
  client gets UNAVAILABLE.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from proc_server import PROC_SECURITY, ServerProcess
from sample_images import random_png
from vlkv.common.grpc_server import make_sync_channel
from vlkv.deploy.client import build_request, connect, generate
from vlkv.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc

Q = "what colour is the square ?"
DEADLINE_S = 4.0  # transfer.deadline_s of every process
KEEPALIVE_S = 1.0  # keepalive_s of every process
CHUNK_DELAY_MS = 150  # the prefill workers' pause before each KV chunk after the header
CACHE_WAIT_MS = 3000  # the decode worker's lease of an unclaimed cache


class Procs:
    """The worker processes of this module, and gateways started on demand."""

    def __init__(self, workdir, model: str) -> None:
        self.workdir = workdir
        self.model = model
        common = ("--model", model, "--deadline-s", str(DEADLINE_S), "--keepalive-s", str(KEEPALIVE_S))
        self.prefill = [
            ServerProcess("prefill", workdir, f"prefill{i}", *common, "--chunk-delay-ms", str(CHUNK_DELAY_MS))
            for i in range(2)
        ]
        self.decode = ServerProcess(
            "decode", workdir, "decode", *common, "--pool-mb", "8", "--cache-wait-ms", str(CACHE_WAIT_MS)
        )
        for p in [*self.prefill, self.decode]:
            p.wait_address()
        self.gateways: list[ServerProcess] = []

    def live_prefill(self) -> list[ServerProcess]:
        return [p for p in self.prefill if p.proc.poll() is None]

    def gateway(self, port: int = 0) -> ServerProcess:
        """The running gateway (routing to both prefill workers and the decode worker), started if none is."""
        if self.gateways and self.gateways[-1].proc.poll() is None:
            return self.gateways[-1]
        flags = ["--model", self.model, "--deadline-s", str(DEADLINE_S), "--keepalive-s", str(KEEPALIVE_S)]
        flags += ["--decode", self.decode.address, "--port", str(port)]
        for p in self.prefill:
            flags += ["--prefill", p.address]
        g = ServerProcess("gateway", self.workdir, f"gateway{len(self.gateways)}", *flags)
        self.gateways.append(g)
        g.wait_address()
        return g

    def stop(self) -> None:
        everyone = [*self.gateways, *self.prefill, self.decode]
        for p in everyone:
            p.terminate()
        for p in everyone:
            p.stop()


@pytest.fixture(scope="module")
def procs(tiny_model_dirs, tmp_path_factory):
    p = Procs(tmp_path_factory.mktemp("procs"), tiny_model_dirs("llava-gqa"))
    yield p
    p.stop()


def _request(max_new_tokens: int = 6, image: int = 1):
    return build_request(images=[random_png(image)], question=Q, max_new_tokens=max_new_tokens, policy="full")


@pytest.fixture(scope="module")
def reference(procs):
    """The normal answer to ``_request()``, through a healthy cluster."""
    channel, stub = connect(procs.gateway().address)
    try:
        out = generate(stub, _request(), timeout=60)
    finally:
        channel.close()
    assert out.finished is not None and out.token_ids
    return out


def _load(address: str, stub_cls=worker_pb2_grpc.DecodeWorkerStub) -> worker_pb2.WorkerLoad:
    with make_sync_channel(address, PROC_SECURITY) as ch:
        return stub_cls(ch).GetLoad(worker_pb2.LoadRequest(), timeout=5)


def _status(gateway: ServerProcess) -> admin_pb2.ClusterStatus:
    with grpc.insecure_channel(gateway.address) as ch:
        return admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.StatusRequest(), timeout=10)


def _wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _pool_back(procs, total: int, timeout: float = 20) -> None:
    def idle() -> bool:
        load = _load(procs.decode.address)
        return load.free_blocks == total and load.running == 0 and load.waiting == 0

    _wait(idle, timeout, "the decode pool to return to its starting free-block count")


class Call(threading.Thread):
    """One streaming Generate call on its own thread: tokens as they come, then the result or the error."""

    def __init__(self, address: str, request, timeout: float = 90) -> None:
        super().__init__(daemon=True)
        self.channel, self.stub = connect(address)
        self.request, self.timeout = request, timeout
        self.token_ids: list[int] = []
        self.text = ""
        self.finished = None
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            for resp in self.stub.Generate(self.request, timeout=self.timeout):
                if resp.HasField("token"):
                    self.token_ids.extend(resp.token.token_ids)
                    self.text += resp.token.text
                else:
                    self.finished = resp.finished
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.channel.close()

    def result(self, timeout: float = 90) -> Call:
        self.join(timeout)
        assert not self.is_alive(), "the call did not end"
        return self


def _mid_transfer(procs, total: int) -> None:
    """Wait until the decode worker has reserved blocks for a cache that is still arriving."""
    _wait(lambda: _load(procs.decode.address).free_blocks < total, 30, "the KV hand-off to start")


# -- the gateway restarts with streams in flight ------------------------------------------------------------
def test_gateway_killed_with_streams_in_flight(procs, reference):
    gateway = procs.gateway()
    total = _load(procs.decode.address).total_blocks
    _pool_back(procs, total)
    calls = [Call(gateway.address, _request(max_new_tokens=900, image=10 + i)) for i in range(3)]
    _wait(lambda: all(len(c.token_ids) >= 2 or c.error for c in calls), 60, "every stream to start")
    load = _load(procs.decode.address)
    assert load.running == 3 and load.free_blocks < total  # all three are decoding, holding blocks

    gateway.kill()
    for c in calls:
        c.result(30)
        assert c.finished is None, "a stream finished although its gateway died"
        assert c.error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), c.error
    # the decode worker saw its Decode streams break and freed every sequence
    _pool_back(procs, total)

    port = int(gateway.address.rsplit(":", 1)[1])
    again = procs.gateway(port)  # a new gateway process on the same port and workers
    assert again is not gateway and again.address == gateway.address
    out = Call(again.address, _request()).result()
    assert out.error is None
    assert out.token_ids == reference.token_ids and out.text == reference.text
    _pool_back(procs, total)


# -- more sequences than the decode pool holds ---------------------------------------------------------------
def test_filled_pool_preempts_and_every_request_finishes(procs, reference):
    """24 streams of 900 new tokens outgrow the 8 MiB pool (~2,000 blocks; each grows to ~118): the decode
    worker preempts the newest to host memory and resumes it when blocks free; every client gets its whole
    answer and the pool returns to its starting free count."""
    gateway = procs.gateway()
    total = _load(procs.decode.address).total_blocks
    _pool_back(procs, total)
    before = _load(procs.decode.address).preemptions
    calls = [
        Call(gateway.address, _request(max_new_tokens=900, image=40 + i), timeout=240) for i in range(24)
    ]
    for c in calls:
        c.result(240)
        assert c.error is None, c.error
        assert c.finished is not None and len(c.token_ids) == c.finished.usage.generated_tokens
    load = _load(procs.decode.address)
    assert load.preemptions > before and load.swapped == 0
    _pool_back(procs, total)
    out = Call(gateway.address, _request()).result()
    assert out.error is None and out.token_ids == reference.token_ids


# -- a decode worker stalls while its cache arrives ---------------------------------------------------------
def test_decode_worker_stopped_mid_transfer(procs, reference):
    gateway = procs.gateway()
    total = _load(procs.decode.address).total_blocks
    _pool_back(procs, total)
    call = Call(gateway.address, _request(image=20), timeout=120)
    _mid_transfer(procs, total)
    procs.decode.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        call.result(60)
        # the sender's deadline ended the hand-off; the client got a defined status, not a hang
        assert call.error is not None and call.finished is None
        assert call.error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert procs.decode.address not in call.error.details()  # internal addresses stay in the log
        assert call.ended_at - stopped_at < 3 * DEADLINE_S + 10  # bounded: no timing claim beyond that
        # the prefill workers answer and hold no work: the stuck hand-off was abandoned
        for p in procs.prefill:
            load = _load(p.address, worker_pb2_grpc.PrefillWorkerStub)
            assert load.running == 0 and load.waiting == 0
    finally:
        procs.decode.signal(signal.SIGCONT)
    _pool_back(procs, total, timeout=CACHE_WAIT_MS / 1000 + 20)  # abort, or the lease, frees the cache
    out = Call(gateway.address, _request()).result()
    assert out.error is None and out.token_ids == reference.token_ids
    _pool_back(procs, total)


def test_decode_worker_stopped_mid_stream(procs, reference):
    gateway = procs.gateway()
    total = _load(procs.decode.address).total_blocks
    _pool_back(procs, total)
    call = Call(gateway.address, _request(max_new_tokens=900, image=25), timeout=120)
    _wait(lambda: len(call.token_ids) >= 2 or call.error, 60, "the stream to start")
    procs.decode.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        call.result(60)
        # the gateway's keepalive pings went unanswered: the stream ends with a status, not a hang
        assert call.error is not None and call.finished is None
        assert call.error.code() == grpc.StatusCode.UNAVAILABLE, call.error
        details = call.error.details()
        assert "decode worker failed" in details and procs.decode.address not in details, details
        assert call.ended_at - stopped_at < 10 * KEEPALIVE_S + 10  # bounded: no timing claim beyond that
    finally:
        procs.decode.signal(signal.SIGCONT)
    _pool_back(procs, total)  # the resumed worker sees its Decode stream gone and frees the sequence
    out = Call(gateway.address, _request()).result()
    assert out.error is None and out.token_ids == reference.token_ids
    _pool_back(procs, total)


# -- a prefill worker dies while it streams a cache ---------------------------------------------------------
def _kill_sender(procs, gateway: ServerProcess) -> ServerProcess:
    """SIGKILL the prefill worker the gateway has the request on (the hand-off is in flight)."""
    busy = [w.address for w in _status(gateway).workers if w.kind == "prefill" and w.in_flight == 1]
    assert len(busy) == 1, busy
    victim = next(p for p in procs.prefill if p.address == busy[0])
    victim.kill()
    return victim


def test_prefill_worker_killed_mid_transfer_is_retried(procs, reference):
    assert len(procs.live_prefill()) == 2
    gateway = procs.gateway()
    total = _load(procs.decode.address).total_blocks
    _pool_back(procs, total)
    call = Call(gateway.address, _request())
    _mid_transfer(procs, total)
    victim = _kill_sender(procs, gateway)
    call.result()
    assert call.error is None, call.error
    # the retry on the other prefill worker produced the normal answer, from a complete second hand-off
    assert call.token_ids == reference.token_ids and call.text == reference.text
    assert call.finished.reason == reference.finished.reason
    assert f"prefill worker {victim.address} failed" in gateway.log_tail(20_000)
    # the partial cache of the dead sender was freed (a leak would keep blocks allocated)
    _pool_back(procs, total)


def test_last_prefill_worker_killed_mid_transfer_is_unavailable(procs):
    """After the previous test one prefill worker is left (the gateway still lists the dead one)."""
    assert len(procs.live_prefill()) == 1, "run after test_prefill_worker_killed_mid_transfer_is_retried"
    gateway = procs.gateway()
    total = _load(procs.decode.address).total_blocks
    _pool_back(procs, total)
    call = Call(gateway.address, _request(image=30))
    _mid_transfer(procs, total)
    _kill_sender(procs, gateway)
    call.result()
    assert call.finished is None and call.error is not None
    assert call.error.code() == grpc.StatusCode.UNAVAILABLE, call.error
    _pool_back(procs, total)  # the partial cache was freed
