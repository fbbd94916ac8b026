"""The gateway's Prometheus endpoint and the Admin status API."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.deploy.client import build_request, generate
from vlkv.services.metrics import serve_metrics
from vlkv.v1 import admin_pb2, admin_pb2_grpc


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=2 << 20)
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


def test_metrics_and_status_reflect_requests(cluster):
    http = serve_metrics(cluster.gateway.servicer.metrics, 0)
    try:
        generate(
            cluster.stub,
            build_request(images=[random_png(1)], question="what ?", max_new_tokens=4, budget=0.2),
        )
        with pytest.raises(grpc.RpcError):
            generate(cluster.stub, build_request(prompt="what ?", budget=7.0))
        with grpc.insecure_channel(cluster.gateway.address) as ch:
            st = admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.StatusRequest(), timeout=10)
        kinds = sorted(w.kind for w in st.workers)
        assert kinds == ["decode", "prefill"] and st.requests_total == 2 and st.requests_in_flight == 0
        decode = next(w for w in st.workers if w.kind == "decode")
        assert decode.state == "serving" and decode.free_blocks == decode.total_blocks > 0
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{http.server_port}/metrics", timeout=10).read().decode()
        )
    finally:
        http.shutdown()
    assert 'vlkv_requests_total{front="grpc",status="OK"} 1.0' in body
    assert 'vlkv_requests_total{front="grpc",status="INVALID_ARGUMENT"} 1.0' in body
    assert 'vlkv_ttft_seconds_count{front="grpc"} 1.0' in body
    assert "vlkv_decode_pool_occupancy" in body and "vlkv_compression_ratio_bucket" in body
    assert "vlkv_hand_off_seconds_count 1.0" in body and "vlkv_prefill_seconds_count 1.0" in body
    assert "vlkv_admission_queue 0.0" in body and "vlkv_decode_preemptions{" in body


def test_log_lines_carry_the_request_id():
    import io
    import json
    import logging

    from vlkv.common import logs

    stream = io.StringIO()
    logs.setup_logging(logging.INFO, json_lines=True)
    handler = logging.getLogger().handlers[0]
    handler.setStream(stream)
    try:
        token = logs.request_id.set("req-42")
        logging.getLogger("vlkv.test").warning("hello %s", "there")
        logs.request_id.reset(token)
        logging.getLogger("vlkv.test").warning("outside")
    finally:
        logging.getLogger().handlers[:] = []
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["request_id"] == "req-42" and first["msg"] == "hello there" and first["level"] == "WARNING"
    assert second["request_id"] == "-"


def test_vlkv_status_prints_workers_pool_and_preemptions(cluster, capsys):
    from vlkv.deploy.cli.main import main

    assert main(["status", "--address", cluster.gateway.address]) == 0
    out = capsys.readouterr().out
    assert "waiting for KV room: 0" in out and "preempted" in out
    decode = next(line for line in out.splitlines() if line.startswith("decode"))
    blocks = cluster.pool.num_blocks
    assert f"0/{blocks} (0%)" in decode and "0 now/0" in decode and "serving" in decode
