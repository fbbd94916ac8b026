"""The NIXL hand-off between real processes: the decode worker's receiver (``lab/vlkv_lab/bench/kv_receiver.py``, its
``NixlKVReceiver`` and ``Admission`` over a real pool) in a child process, the prefill side's ``NixlKVSender`` here.

Round trips are bit-exact for every KV dtype and per-layer lengths from 1 up; each fault (checksum mismatch,
a non-finite cache, a sender that never says done, a sender killed mid-write, a receiver killed mid-write, NIXL absent on the
receiving side) ends with its status, the receiver serves on and its pool returns to its free count.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from vlkv.common.config import Limits, PrefillConfig, SecurityConfig, TransferConfig
from vlkv.common.errors import Refusal
from vlkv.common.handoff import nixl_sender
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.grpc_transport import GrpcKVSender, grpc_message_options
from vlkv.common.handoff.nixl_agent import NixlAgent, nixl_available, notif_key, parse_notif
from vlkv.common.handoff.nixl_sender import NixlKVSender, StagingPool
from vlkv.common.handoff.quantize import quantize_compact
from vlkv.common.handoff.wire import KVWireError, compact_header
from vlkv.prefill_worker.peers import DecodePeers
from vlkv.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from vlkv_lab.bench.kv_receiver import FINGERPRINT, serve

pytestmark = pytest.mark.skipif(bool(nixl_available()), reason=nixl_available() or "nixl")
H, D = 2, 8
LENGTHS = [1, 2, 15, 16, 17, 40]  # around the block size (16): partial, whole and several blocks
CTX = mp.get_context("spawn")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class Receiver:
    """Receivers (one per dtype, each on its own port) in one child process (``kill`` SIGKILLs it);
    ``use(dtype)`` picks the one the helpers talk to."""

    def __init__(self, tmp: Path, dtypes=(torch.float32,), nixl: bool = True, **transfer) -> None:
        self.q, self.stop_event = CTX.Queue(), CTX.Event()
        self.dump = tmp
        layouts = [(len(LENGTHS), H, D, dtype) for dtype in dtypes]
        kwargs = dict(pool_mib=2, dump_dir=str(tmp), nixl=nixl, **transfer)
        self.proc = CTX.Process(
            target=serve, args=(layouts, self.q, self.stop_event), kwargs=kwargs, daemon=True
        )
        self.proc.start()
        self.ports = dict(zip(dtypes, self.q.get(timeout=120), strict=True))
        self.channel = None
        self.use(dtypes[0])

    def use(self, dtype: torch.dtype) -> Receiver:
        port, self.total = self.ports[dtype]
        self.address = f"127.0.0.1:{port}"
        if self.channel is not None:
            self.channel.close()
        self.channel = grpc.insecure_channel(self.address)
        self.stub = worker_pb2_grpc.DecodeWorkerStub(self.channel)
        return self

    def load(self) -> worker_pb2.WorkerLoad:
        return self.stub.GetLoad(worker_pb2.LoadRequest(), timeout=10)

    def wait_free(self, timeout: float = 15) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.load().free_blocks == self.total:
                return True
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        self.channel.close()
        self.stop_event.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


def make_cache(dtype: torch.dtype, seed: int = 0) -> CompactKV:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(H, k, D, generator=g).to(dtype) for k in LENGTHS]
    values = [torch.randn(H, k, D, generator=g).to(dtype) for k in LENGTHS]
    return CompactKV(keys, values, prompt_length=max(LENGTHS), first_token=3)


def header_of(ckv: CompactKV, rid: str):
    return compact_header(
        ckv, request_id=rid, fingerprint=FINGERPRINT, sampling=generate_pb2.SamplingParams(max_new_tokens=4)
    )


class Sender:
    """The prefill side: its own NIXL agent and staging buffers, one channel per receiver address."""

    def __init__(self) -> None:
        self.agent = NixlAgent("prefill")
        self.staging = StagingPool(self.agent)

    def send(self, address: str, ckv: CompactKV, rid: str, **kwargs):
        async def go():
            ch = grpc.aio.insecure_channel(address, options=grpc_message_options())
            try:
                return await NixlKVSender(ch, address, self.agent, self.staging, **kwargs).send(
                    header_of(ckv, rid), ckv
                )
            finally:
                await ch.close()

        return asyncio.run(go())


@pytest.fixture(scope="module")
def sender():
    return Sender()


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    """One process for the round trips and the faults a receiver survives (write window 1.5 s)."""
    r = Receiver(tmp_path_factory.mktemp("kv"), DTYPES, write_window_s=1.5)
    yield r
    r.close()


def expected_bytes(ckv: CompactKV) -> bytes:
    return b"".join(
        t.contiguous().view(torch.uint8).numpy().tobytes()
        for kv in zip(ckv.keys, ckv.values, strict=True)
        for t in kv
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_between_processes_is_bit_exact(sender, receiver, dtype):
    r = receiver.use(dtype)
    before = r.load().waiting
    for i in range(2):  # the second transfer reuses the loaded peer and the staging buffer
        ckv = make_cache(dtype, seed=i)
        ack = sender.send(r.address, ckv, f"rt-{dtype}-{i}")
        assert ack.bytes_received == ckv.nbytes and ack.blocks_allocated > 0
        assert (r.dump / f"rt-{dtype}-{i}.kv").read_bytes() == expected_bytes(ckv)
    assert r.load().waiting == before + 2 and r.load().running == 0  # both over NIXL, none over gRPC
    assert r.wait_free()


def test_layer_notifications_parse_as_text_and_odd_ones_are_ignored():
    assert parse_notif(notif_key("req:1", 7)) == ("req:1", 7)
    for odd in (b"", b"vlkv-kv:", b"vlkv-kv:r:x", b"vlkv-kv:\xff:1", b"other:r:1", "vlkv-kv:r:1"):
        assert parse_notif(odd) == (None, -1)


def test_non_finite_cache_is_refused_by_the_sender_and_pool_returns(sender, receiver):
    r = receiver.use(torch.float16)
    ckv = make_cache(torch.float16)
    ckv.values[2][0, 3, 1] = float("nan")
    with pytest.raises(KVWireError) as err:
        sender.send(r.address, ckv, "nan")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert r.wait_free(timeout=5)  # the call was cancelled mid-write: freed when its window (1.5 s) closed
    assert not (r.dump / "nan.kv").exists()


def test_checksum_mismatch_is_data_loss_and_pool_returns(sender, receiver, monkeypatch):
    r = receiver.use(torch.float16)
    tmp_path = r.dump
    real = nixl_sender.tensor_crc32c
    monkeypatch.setattr(nixl_sender, "tensor_crc32c", lambda t, crc=0: real(t, crc) ^ 1)
    with pytest.raises(KVWireError) as err:
        sender.send(r.address, make_cache(torch.float16), "bad-crc")
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert r.wait_free(timeout=2)  # freed at once: the sender's writes had all completed
    monkeypatch.undo()
    sender.send(r.address, make_cache(torch.float16), "good-after")
    assert not (tmp_path / "bad-crc.kv").exists() and (tmp_path / "good-after.kv").exists()


def test_sender_that_never_says_done_is_cut_at_its_window(receiver):
    r = receiver.use(torch.float32)
    ckv = make_cache(torch.float32)
    call = r.stub.TransferKVNixl(
        iter(
            [worker_pb2.NixlTransferRequest(open=worker_pb2.NixlOpen(header=header_of(ckv, "silent").header))]
        ),
        timeout=30,
    )  # the request stream ends after open: the receiver waits for done within the write window
    with pytest.raises(grpc.RpcError) as err:
        for reply in call:
            assert reply.HasField("regions") and reply.regions.agent_metadata  # unknown sender: metadata
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert r.load().free_blocks < r.total  # held: writes could still land until the window closes
    assert r.wait_free(timeout=5)


def _send_slowly(address: str, dtype: torch.dtype) -> None:  # runs in a child process, killed mid-write
    Sender().send(address, make_cache(dtype), "killed", layer_delay_s=5.0)


def test_sender_killed_mid_write_frees_after_the_window(sender, receiver):
    r = receiver.use(torch.float16)
    tmp_path = r.dump
    child = CTX.Process(target=_send_slowly, args=(r.address, torch.float16), daemon=True)
    child.start()
    end = time.monotonic() + 60
    while r.load().free_blocks == r.total and time.monotonic() < end:
        time.sleep(0.02)
    assert r.load().free_blocks < r.total  # admitted, regions handed out, first layer written
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert r.wait_free(timeout=10)
    sender.send(r.address, make_cache(torch.float16), "after-kill")  # serves on
    assert not (tmp_path / "killed.kv").exists()


def test_receiver_killed_mid_write_then_a_restarted_one_is_served(sender, tmp_path):
    r = Receiver(tmp_path, (torch.bfloat16,), write_window_s=2.0)
    box: dict = {}

    def send():
        try:
            sender.send(r.address, make_cache(torch.bfloat16), "lost", layer_delay_s=0.5)
        except KVWireError as exc:
            box["err"] = exc

    import threading

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.3)
    while r.load().free_blocks == r.total:
        time.sleep(0.02)
    r.kill()
    t.join(60)
    assert box["err"].code == grpc.StatusCode.UNAVAILABLE
    r2 = Receiver(tmp_path, (torch.bfloat16,))  # a new process: a new agent (its metadata is loaded anew)
    try:
        sender.send(r2.address, make_cache(torch.bfloat16), "new-peer")
        assert (tmp_path / "new-peer.kv").read_bytes() == expected_bytes(make_cache(torch.bfloat16))
    finally:
        r2.close()


def test_receiver_without_nixl_refuses_and_auto_falls_back_to_grpc(tmp_path):
    r = Receiver(tmp_path, nixl=False)
    try:
        ckv = make_cache(torch.float32)
        with pytest.raises(KVWireError) as err:
            Sender().send(r.address, ckv, "no-nixl")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.reason == Refusal.REFUSAL_TRANSPORT_UNAVAILABLE
        for transport, ok in (("nixl", False), ("auto", True)):
            transfer = TransferConfig(kv_transport=transport, nixl_min_bytes=0)  # this small cache tries NIXL
            cfg = PrefillConfig(Limits(), transfer, SecurityConfig(), 0.0)

            async def go(cfg=cfg, rid=f"via-{transport}"):
                peers = DecodePeers(cfg, NixlAgent("prefill"))
                try:
                    return await peers.send(r.address, header_of(ckv, rid), ckv)
                finally:
                    await peers.close()

            if ok:
                assert asyncio.run(go()).bytes_received == ckv.nbytes
            else:
                with pytest.raises(KVWireError):
                    asyncio.run(go())
        assert r.load().running == 1 and r.load().waiting == 0  # the fallback went over gRPC
        assert (tmp_path / "via-auto.kv").read_bytes() == expected_bytes(ckv)
    finally:
        r.close()


def test_auto_sends_caches_below_nixl_min_bytes_over_grpc():
    ckv = make_cache(torch.float32)
    agent = NixlAgent("prefill-size")

    async def kinds(transport: str, min_bytes: int) -> list[str]:
        cfg = PrefillConfig(
            Limits(), TransferConfig(kv_transport=transport, nixl_min_bytes=min_bytes), SecurityConfig(), 0.0
        )
        peers = DecodePeers(cfg, agent)
        try:
            return [type(s).__name__ for s in peers.senders("127.0.0.1:1", ckv.nbytes)]
        finally:
            await peers.close()

    assert asyncio.run(kinds("auto", ckv.nbytes + 1)) == ["GrpcKVSender"]
    assert asyncio.run(kinds("auto", ckv.nbytes)) == ["NixlKVSender", "GrpcKVSender"]
    assert asyncio.run(kinds("nixl", ckv.nbytes + 1)) == ["NixlKVSender"]  # an explicit choice is kept
    with pytest.raises(ValueError):
        TransferConfig(nixl_min_bytes=-1)


def test_int8_cache_between_processes_over_nixl_and_grpc(tmp_path):
    r = Receiver(tmp_path, (torch.float32,), kv_dtype="int8")
    try:
        sender = Sender()
        q = quantize_compact(make_cache(torch.float32), "int8")
        ack = sender.send(r.address, q, "int8-rt")
        assert ack.bytes_received == q.nbytes
        want = b"".join(
            t.contiguous().view(torch.uint8).numpy().tobytes()
            for layer in zip(q.keys, q.values, q.k_scales, q.v_scales, strict=True)
            for t in layer
        )
        assert (tmp_path / "int8-rt.kv").read_bytes() == want  # K, V and scales, bit for bit
        assert len(q.keys) == len(LENGTHS) and r.wait_free()
        # the same cache over gRPC (TransferKV) into the same int8 pool: the same bytes land
        ack = asyncio.run(_grpc_send(r.address, q, "int8-grpc", header_of))
        assert ack.bytes_received == q.nbytes
        assert (tmp_path / "int8-grpc.kv").read_bytes() == want and r.wait_free()
        with pytest.raises(KVWireError) as err:  # an fp16 cache over gRPC to an int8 pool
            asyncio.run(_grpc_send(r.address, make_cache(torch.float32), "fp-grpc", header_of))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--kv-dtype" in err.value.message
        with pytest.raises(KVWireError) as err:  # an fp16 cache to an int8 pool
            sender.send(r.address, make_cache(torch.float32), "fp-to-int8")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert r.wait_free()
    finally:
        r.close()


async def _grpc_send(address: str, ckv: CompactKV, rid: str, header_of):
    ch = grpc.aio.insecure_channel(address, options=grpc_message_options())
    try:
        return await GrpcKVSender(ch, chunk_bytes=4096).send(header_of(ckv, rid), ckv)
    finally:
        await ch.close()
