"""The OpenAI-compatible HTTP front over an in-process cluster, and the ``openai`` client's messages for it (the
HTTP front's tests share them)."""

from __future__ import annotations

import base64

import openai
from inproc_cluster import InProcCluster
from vlkv.common.config import Limits, ModelConfig, PoolConfig, QueueConfig, ServerConfig
from vlkv.common.security import SecurityConfig
from vlkv.deploy.client import connect
from vlkv.deploy.servers import start_http_front
from vlkv.services.http_front import HttpFrontConfig

TOKEN = "s3cret"
MODEL = "tiny-llava"
Q = "what colour is the square ?"
MAX_IMAGE_BYTES = 48 << 10
MAX_BODY_BYTES = 256 << 10


def data_url(blob: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(blob).decode()


def chat(url: str, text: str = Q) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


class Front:
    """An in-process cluster (no admission queue: max_waiting=0) with the HTTP front and a gRPC client."""

    def __init__(self, model_dir: str) -> None:
        self.cfg = ServerConfig(
            model=ModelConfig(path=model_dir),
            pool=PoolConfig(pool_bytes=4 << 20),
            limits=Limits(max_image_bytes=MAX_IMAGE_BYTES),
            queue=QueueConfig(max_waiting=0),
            security=SecurityConfig(api_token=TOKEN),
        )
        self.cluster = InProcCluster(self.cfg, client=False)
        self.channel, self.stub = connect(self.cluster.gateway.address, token=TOKEN)
        self.http = self.start_http(self.cluster.gateway)
        self.client = self.openai(self.http.url)
        self.extra: list = []

    def start_http(self, gateway, **kw):
        front = HttpFrontConfig(model_id=MODEL, max_body_bytes=MAX_BODY_BYTES, **kw)
        return self.cluster.run(start_http_front(gateway, 0, self.cfg, front))

    @staticmethod
    def openai(url: str, key: str = TOKEN) -> openai.OpenAI:
        return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)

    def close(self) -> None:
        self.channel.close()
        for server in [self.http, *self.extra]:
            self.cluster.run(server.stop())
        self.cluster.close()
