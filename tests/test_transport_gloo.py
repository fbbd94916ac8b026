"""torch.distributed point-to-point KV hand-off on CPU with gloo (the NCCL path's stand-in).

Two spawned processes: rank 0 sends, rank 1 receives and checks against the same seeded caches.
"""

from __future__ import annotations

import datetime
import os

import grpc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from vlkv.common.handoff.torch_dist import recv_compact_kv, send_compact_kv
from vlkv.common.handoff.wire import KVWireError

from tests.kv_wire_helpers import FP, FakePool, bits_equal, encode, make_ckv

CASES = [(torch.float32, [1, 2, 50]), (torch.float16, [7, 1, 300]), (torch.bfloat16, [3, 64, 64])]


def _layers(ckv, log: list[str]):
    """Yields layers lazily, logging when each one is produced (to see sends overlap production)."""
    for i, kv in enumerate(zip(ckv.keys, ckv.values, strict=True)):
        log.append(f"produce {i}")
        yield kv


def _sender(ckv, fingerprint: str = FP) -> None:
    log: list[str] = []
    sent = send_compact_kv(encode(ckv, fingerprint=fingerprint)[0], _layers(ckv, log), dst=1)
    assert sent == ckv.nbytes and len(log) == ckv.num_layers


def _receiver(ckv, pool: FakePool):
    layout = (ckv.num_layers, ckv.num_kv_heads, ckv.head_dim, ckv.dtype)
    return recv_compact_kv(0, FP, layout, allocate=pool.allocate, release=pool.release)


def _worker(rank: int, store_path: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=5),
    )
    pool = FakePool()
    try:
        for seed, (dtype, lengths) in enumerate(CASES):
            ckv = make_ckv(dtype, lengths, seed=seed)
            if rank == 0:
                _sender(ckv)
                continue
            header, out, handle = _receiver(ckv, pool)
            assert header.request_id == "req-1" and out.first_token == 7
            pairs = zip(out.keys + out.values, ckv.keys + ckv.values, strict=True)
            assert all(bits_equal(a, b) for a, b in pairs)
            pool.release(handle)

        # A cache for another model is refused before allocation; both sides see FAILED_PRECONDITION.
        ckv = make_ckv(torch.float16, [2, 3])
        try:
            _sender(ckv, "another-model") if rank == 0 else _receiver(ckv, pool)
            raise AssertionError("the transfer should have been refused")
        except KVWireError as err:
            assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        if rank == 1:
            _, out, handle = _receiver(ckv, pool)  # ... and the next transfer still works
            pool.release(handle)
            assert (pool.allocs, pool.releases, pool.free) == (4, 4, pool.total)
        else:
            _sender(ckv)

        # The sender dies mid-transfer (bad layer): the receiver times out with DATA_LOSS, blocks freed.
        if rank == 0:
            bad = [(ckv.keys[0], ckv.values[0]), (ckv.keys[0], ckv.values[0])]
            with pytest.raises(ValueError):
                send_compact_kv(encode(ckv)[0], iter(bad), dst=1)
        else:
            with pytest.raises(KVWireError) as exc:
                _receiver(ckv, pool)
            assert exc.value.code == grpc.StatusCode.DATA_LOSS
            assert (pool.allocs, pool.releases, pool.free) == (5, 5, pool.total)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_gloo_round_trip_refusal_and_broken_sender(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)
