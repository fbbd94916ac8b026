"""TLS on every channel, mutual TLS between workers, and the public API's bearer token."""

from __future__ import annotations

import grpc
import pytest
from vlkv.common.config import ConfigError, ModelConfig, PoolConfig, SecurityConfig, ServerConfig
from vlkv.common.grpc_server import channel_options
from vlkv.tools.client import build_request, connect, generate
from vlkv.v1 import worker_pb2, worker_pb2_grpc

from tests.inproc_cluster import InProcCluster
from tests.test_e2e_equality import random_png
from tests.tls_certs import make_pki

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, pki):
    sec = SecurityConfig(cert=pki["cert"], key=pki["key"], ca=pki["ca"], mutual_tls=True, api_token=TOKEN)
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=2 << 20),
        security=sec,
    )
    c = InProcCluster(cfg, client=False)
    yield c
    c.close()


def _ask(address, **kw):
    channel, stub = connect(address, **kw)
    try:
        return generate(
            stub, build_request(images=[random_png(1)], question="what ?", max_new_tokens=3), timeout=30
        )
    finally:
        channel.close()


def test_tls_mtls_and_token_serve_a_request(cluster, pki):
    out = _ask(cluster.gateway.address, token=TOKEN, ca=pki["ca"])
    assert out.finished is not None and out.finished.usage.generated_tokens >= 1


@pytest.mark.parametrize("token", ["", "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated(cluster, pki, token):
    with pytest.raises(grpc.RpcError) as err:
        _ask(cluster.gateway.address, token=token, ca=pki["ca"])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_client_is_refused(cluster):
    with pytest.raises(grpc.RpcError) as err:
        _ask(cluster.gateway.address)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_gateway_with_an_unknown_ca_is_refused(cluster, pki):
    with pytest.raises(grpc.RpcError) as err:
        _ask(cluster.gateway.address, token=TOKEN, ca=pki["rogue_ca"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _worker_load(address: str, creds) -> worker_pb2.WorkerLoad:
    with grpc.secure_channel(address, creds, options=channel_options(1 << 20)) as ch:
        return worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(worker_pb2.LoadRequest(), timeout=10)


def test_workers_require_a_client_certificate_from_our_ca(cluster, pki):
    address = cluster.decode.address
    ca = open(pki["ca"], "rb").read()
    good = grpc.ssl_channel_credentials(ca, open(pki["key"], "rb").read(), open(pki["cert"], "rb").read())
    assert _worker_load(address, good).total_blocks > 0
    rogue = grpc.ssl_channel_credentials(
        ca, open(pki["rogue_key"], "rb").read(), open(pki["rogue_cert"], "rb").read()
    )
    for creds in (grpc.ssl_channel_credentials(ca), rogue):  # no client cert; a cert from another CA
        with pytest.raises(grpc.RpcError) as err:
            _worker_load(address, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_insecure_mode_only_on_loopback(tiny_model_dirs):
    with pytest.raises(ConfigError, match="without TLS"):
        ServerConfig(model=ModelConfig(path=tiny_model_dirs("llava-gqa")), host="0.0.0.0")
