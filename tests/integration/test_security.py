"""TLS on every channel, mutual TLS between workers, the public API's bearer token, and the internal token
that authenticates calls to the worker ports when there is no mutual TLS (issue 15, item 4)."""

from __future__ import annotations

import argparse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inproc_cluster import InProcCluster
from sample_images import random_png
from tls_certs import make_pki
from vlkv.common.config import ConfigError, ModelConfig, PoolConfig, SecurityConfig, ServerConfig
from vlkv.common.grpc_server import channel_options
from vlkv.deploy.cli.cluster import server_config
from vlkv.deploy.cli.flags import add_server_flags
from vlkv.deploy.client import build_request, connect, generate
from vlkv.v1 import worker_pb2, worker_pb2_grpc

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _secure_cluster(tiny_model_dirs, sec: SecurityConfig):
    """An in-process cluster of the tiny GQA model with ``sec`` on every channel (no insecure client)."""
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=2 << 20),
        security=sec,
    )
    c = InProcCluster(cfg, client=False)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, pki):
    sec = SecurityConfig(cert=pki["cert"], key=pki["key"], ca=pki["ca"], mutual_tls=True, api_token=TOKEN)
    yield from _secure_cluster(tiny_model_dirs, sec)


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


# -- TLS and tokens without mutual TLS: the worker ports take only calls carrying the internal token ------
INTERNAL = "internal-s3cret"


@pytest.fixture(scope="module")
def token_cluster(tiny_model_dirs, pki):
    """TLS on every channel, the public bearer token, no client certificates: what `vlkv serve --tls-cert
    ... --api-token ...` runs (it draws the internal token itself)."""
    sec = SecurityConfig(
        cert=pki["cert"], key=pki["key"], ca=pki["ca"], api_token=TOKEN, internal_token=INTERNAL
    )
    yield from _secure_cluster(tiny_model_dirs, sec)


class _Token(grpc.AuthMetadataPlugin):
    def __init__(self, value: str) -> None:
        self.value = value

    def __call__(self, context, callback) -> None:
        callback((("vlkv-internal-token", self.value),), None)


def _creds(pki, internal_token: str | None):
    """What a peer holding only the public CA certificate can build (plus a token, if it has one)."""
    creds = grpc.ssl_channel_credentials(open(pki["ca"], "rb").read())
    if internal_token is not None:
        creds = grpc.composite_channel_credentials(
            creds, grpc.metadata_call_credentials(_Token(internal_token))
        )
    return creds


def _call(address: str, creds, service: str, method) -> grpc.StatusCode:
    """Call ``method`` of ``service`` with an empty message (raw bytes); the status it ends with (``creds``
    None: a plain insecure channel)."""
    path = f"/{service}/{method.name}"
    options = channel_options(1 << 20)
    channel = grpc.insecure_channel(address, options) if creds is None else None
    with channel or grpc.secure_channel(address, creds, options=options) as ch:
        kind = {
            (False, False): ch.unary_unary,
            (False, True): ch.unary_stream,
            (True, False): ch.stream_unary,
            (True, True): ch.stream_stream,
        }[(method.client_streaming, method.server_streaming)]
        call = kind(path)
        request = iter([b""]) if method.client_streaming else b""
        try:
            out = call(request, timeout=10)
            if method.server_streaming:
                list(out)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _worker_methods(cluster):
    for address, name in (
        (cluster.decode.address, "DecodeWorker"),
        (cluster.prefill.address, "PrefillWorker"),
    ):
        service = worker_pb2.DESCRIPTOR.services_by_name[name]
        for method in service.methods:
            yield address, service.full_name, method


def test_tls_and_token_without_mtls_serve_a_request(token_cluster, pki):
    out = _ask(token_cluster.gateway.address, token=TOKEN, ca=pki["ca"])
    assert out.finished is not None and out.finished.usage.generated_tokens >= 1


@pytest.mark.parametrize("token", [None, "", "wrong-token", TOKEN])
def test_worker_ports_refuse_peers_without_the_internal_token(token_cluster, pki, token):
    """With only the public CA certificate (and no token, a wrong one, or the public API's token), every
    worker method ends UNAUTHENTICATED before it runs: GetLoad, Prefill, TransferKV, Decode and the rest."""
    creds = _creds(pki, token)
    seen = {}
    for address, service, method in _worker_methods(token_cluster):
        seen[f"{service}/{method.name}"] = _call(address, creds, service, method)
    assert {"vlkv.v1.DecodeWorker/TransferKV", "vlkv.v1.PrefillWorker/Prefill"} <= set(seen)
    assert set(seen.values()) == {grpc.StatusCode.UNAUTHENTICATED}, seen


def test_worker_ports_serve_the_internal_token_and_health_stays_open(token_cluster, pki):
    load = None
    with grpc.secure_channel(
        token_cluster.decode.address, _creds(pki, INTERNAL), options=channel_options(1 << 20)
    ) as ch:
        load = worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(worker_pb2.LoadRequest(), timeout=10)
    assert load.total_blocks > 0
    with grpc.secure_channel(token_cluster.prefill.address, _creds(pki, None)) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_every_deployment_authenticates_its_workers(tiny_model_dirs, pki):
    """Without mutual TLS a ServerConfig draws an internal token when none is given, exposed or local."""
    model = ModelConfig(path=tiny_model_dirs("llava-gqa"))
    tls = dict(cert=pki["cert"], key=pki["key"], ca=pki["ca"], api_token=TOKEN)
    exposed = [ServerConfig(model=model, host="0.0.0.0", security=SecurityConfig(**tls)) for _ in range(2)]
    local = ServerConfig(model=model)
    drawn = [c.security.internal_token for c in (*exposed, local)]
    assert all(len(t) >= 32 for t in drawn) and len(set(drawn)) == 3
    given = ServerConfig(model=model, security=SecurityConfig(internal_token=INTERNAL))
    assert given.security.internal_token == INTERNAL
    mtls = ServerConfig(model=model, host="0.0.0.0", security=SecurityConfig(**tls, mutual_tls=True))
    assert mtls.security.authenticates_workers and not mtls.security.internal_token


def test_vlkv_serve_draws_an_internal_token_unless_mtls(pki, monkeypatch):
    monkeypatch.delenv("VLKV_INTERNAL_TOKEN", raising=False)

    def config(*extra):
        parser = argparse.ArgumentParser()
        add_server_flags(parser)
        args = [
            "--host",
            "0.0.0.0",
            "--tls-cert",
            pki["cert"],
            "--tls-key",
            pki["key"],
            "--tls-ca",
            pki["ca"],
        ]
        return server_config(parser.parse_args([*args, "--api-token", TOKEN, *extra])).security

    drawn = [config().internal_token for _ in range(2)]
    assert all(len(t) >= 32 for t in drawn) and drawn[0] != drawn[1]
    assert config("--internal-token", INTERNAL).internal_token == INTERNAL
    mtls = config("--mtls")
    assert mtls.mutual_tls and not mtls.internal_token
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    local = [server_config(parser.parse_args([])).security.internal_token for _ in range(2)]
    assert all(len(t) >= 32 for t in local) and local[0] != local[1]  # the local mode too


# -- The local mode (no TLS): the worker ports still take only calls carrying the internal token ---------


@pytest.fixture(scope="module")
def local_cluster(tiny_model_dirs):
    """The one-machine mode as `vlkv serve` runs it: no TLS, no API token, a drawn internal token."""
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=2 << 20)
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


def _local_creds(internal_token: str | None):
    """Loopback channel credentials (plaintext), with a token if given; None: a plain insecure channel."""
    if internal_token is None:
        return None
    local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    return grpc.composite_channel_credentials(local, grpc.metadata_call_credentials(_Token(internal_token)))


@pytest.mark.parametrize("token", [None, "", "wrong-token"])
def test_local_worker_ports_refuse_calls_without_the_internal_token(local_cluster, token):
    """Loopback is no exception: with no token (a plain insecure channel), an empty or a wrong one, every
    method of both workers ends UNAUTHENTICATED before it runs."""
    seen = {}
    for address, service, method in _worker_methods(local_cluster):
        seen[f"{service}/{method.name}"] = _call(address, _local_creds(token), service, method)
    assert {"vlkv.v1.DecodeWorker/TransferKV", "vlkv.v1.PrefillWorker/Prefill"} <= set(seen)
    assert set(seen.values()) == {grpc.StatusCode.UNAUTHENTICATED}, seen


def test_local_mode_serves_with_the_drawn_token(local_cluster):
    out = generate(
        local_cluster.stub,
        build_request(images=[random_png(1)], question="what ?", max_new_tokens=3),
        timeout=30,
    )
    assert out.finished is not None and out.finished.usage.generated_tokens >= 1
    creds = _local_creds(local_cluster.cfg.security.internal_token)
    with grpc.secure_channel(local_cluster.decode.address, creds) as ch:
        load = worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(worker_pb2.LoadRequest(), timeout=10)
    assert load.total_blocks > 0 and load.free_blocks == load.total_blocks
