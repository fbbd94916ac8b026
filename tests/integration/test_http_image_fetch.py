"""Remote image URLs on the HTTP front against real local hosts: a host that trickles its answer one byte at a
time ends each fetch at the fetch deadline (504), never holds a fetch from another host or a data-URL
request, and redirects, oversized bodies and error statuses get clear 4xx answers."""

from __future__ import annotations

import asyncio
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from http_front_harness import MAX_IMAGE_BYTES, MODEL, Front, chat, data_url
from sample_images import random_png
from vlkv.services.image_fetch import FetchConfig, ImageFetcher
from vlkv.services.metrics import GatewayMetrics
from vlkv.services.openai_schema import ApiError

DEADLINE_S = 3.0  # the fetch deadline of these tests
MARGIN_S = 2.0  # a trickled fetch ends within DEADLINE_S + MARGIN_S; another host's fetch within MARGIN_S
TRICKLE_S = 1.0  # one byte per this many seconds
SLOW = 8  # trickling fetches at once (twice the per-host limit of 4)
PNG = random_png(7)


class _Trickle(socketserver.BaseRequestHandler):
    """/head: the whole answer one byte at a time; /body: the headers at once, then the body byte by byte."""

    def handle(self) -> None:
        self.server.dialled += 1
        request = b""
        while b"\r\n\r\n" not in request:
            got = self.request.recv(4096)
            if not got:
                return
            request += got
        head = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 20000\r\n\r\n"
        if b" /body" in request.split(b"\r\n", 1)[0]:
            self.request.sendall(head)
            head = b""
        out = head + b"\x89PNG" + b"x" * 100
        try:
            for i in range(len(out)):
                self.request.sendall(out[i : i + 1])
                time.sleep(TRICKLE_S)
        except OSError:
            return  # the client gave up


class _Hosts(BaseHTTPRequestHandler):
    """An image host on another port: the image, redirects, an oversized body, a 404."""

    def do_GET(self) -> None:
        self.server.seen.append((self.path, time.monotonic()))
        other = self.server.other_port
        if self.path == "/img.png":
            self._send(200, PNG)
        elif self.path == "/redirect-ok":
            self._redirect(f"http://127.0.0.1:{self.server.server_address[1]}/img.png")
        elif self.path == "/redirect-off":
            self._redirect(f"http://localhost:{other}/img.png")  # localhost is not on the list
        elif self.path == "/redirect-loop":
            self._redirect("/redirect-loop")
        elif self.path == "/big":  # no Content-Length: the limit is enforced as the body streams
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range((MAX_IMAGE_BYTES >> 14) + 4):
                self.wfile.write(b"4000\r\n" + b"x" * (1 << 14) + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._send(404, b"no such image")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class _Servers:
    def __init__(self) -> None:
        socketserver.ThreadingTCPServer.daemon_threads = True
        self.trickle = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Trickle)
        self.trickle.dialled = 0
        self.off_list = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Trickle)  # dialled as localhost
        self.off_list.dialled = 0
        self.hosts = ThreadingHTTPServer(("127.0.0.1", 0), _Hosts)
        self.hosts.seen, self.hosts.other_port = [], self.off_list.server_address[1]
        for s in (self.trickle, self.off_list, self.hosts):
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def url(self, server, path: str) -> str:
        return f"http://127.0.0.1:{server.server_address[1]}{path}"

    def slow_urls(self) -> list[str]:
        return [self.url(self.trickle, "/head" if i % 2 else "/body") for i in range(SLOW)]

    def close(self) -> None:
        for s in (self.trickle, self.off_list, self.hosts):
            s.shutdown()
            s.server_close()


@pytest.fixture(scope="module")
def servers():
    s = _Servers()
    yield s
    s.close()


@pytest.fixture(scope="module")
def front(tiny_model_dirs):
    f = Front(tiny_model_dirs("llava-gqa"))
    http = f.start_http(f.cluster.gateway, allow_image_hosts=("127.0.0.1",), fetch_deadline_s=DEADLINE_S)
    f.extra.insert(0, http)
    f.fetching = f.openai(http.url)
    yield f
    f.close()


def test_trickling_host_ends_at_the_deadline_and_never_holds_another_host(servers):
    metrics = GatewayMetrics()
    fetcher = ImageFetcher(FetchConfig(("127.0.0.1",), deadline_s=DEADLINE_S, per_host=4), metrics)

    async def timed(url: str):
        start = time.monotonic()
        try:
            out = await fetcher.fetch(url, MAX_IMAGE_BYTES)
        except ApiError as exc:
            out = exc
        return out, time.monotonic() - start

    async def run():
        slow = [asyncio.ensure_future(timed(u)) for u in servers.slow_urls()]
        await asyncio.sleep(0.5)  # the slow fetches hold every connection the trickling host may have
        other = await timed(servers.url(servers.hosts, "/img.png"))
        done = await asyncio.gather(*slow)
        await fetcher.close()
        return other, done

    (blob, other_s), slow = asyncio.run(run())
    assert blob == PNG and other_s < MARGIN_S
    for out, took in slow:
        assert isinstance(out, ApiError) and out.status == 504 and "did not send the image" in out.message
        assert took <= DEADLINE_S + MARGIN_S
    assert metrics.registry.get_sample_value("vlkv_image_fetches_total") == SLOW + 1
    assert metrics.registry.get_sample_value("vlkv_image_fetch_failures_total", {"reason": "timeout"}) == SLOW
    assert metrics.registry.get_sample_value("vlkv_image_fetch_seconds_count") == SLOW + 1


def _chat_status(client, url: str) -> tuple[int | str, float]:
    start = time.monotonic()
    try:
        client.chat.completions.create(model=MODEL, messages=chat(url), max_tokens=2)
        status = 200
    except openai.APIStatusError as exc:
        status = exc.status_code
    return status, time.monotonic() - start


def test_trickling_host_through_the_front_gives_504s_and_others_are_served(front, servers):
    with ThreadPoolExecutor(SLOW) as pool:
        slow = [pool.submit(_chat_status, front.fetching, u) for u in servers.slow_urls()]
        time.sleep(0.5)
        asked = time.monotonic()
        other = _chat_status(front.fetching, servers.url(servers.hosts, "/img.png"))
        inline = _chat_status(front.fetching, data_url(random_png(8)))
        results = [f.result() for f in slow]
    assert other[0] == 200 and inline[0] == 200
    dialled = [t for path, t in servers.hosts.seen if path == "/img.png" and t >= asked]
    assert dialled and dialled[0] - asked < MARGIN_S  # the other host was dialled at once
    for status, took in results:
        assert status == 504 and took <= DEADLINE_S + MARGIN_S


@pytest.mark.parametrize(
    "path, status, needle",
    [
        ("/redirect-ok", 200, ""),
        ("/redirect-off", 400, "redirect refused"),
        ("/redirect-loop", 400, "redirects"),
        ("/big", 413, "over the limit"),
        ("/missing", 400, "answered 404"),
    ],
)
def test_redirects_sizes_and_statuses(front, servers, path, status, needle):
    dialled = servers.off_list.dialled
    url = servers.url(servers.hosts, path)
    if status == 200:
        out = front.fetching.chat.completions.create(model=MODEL, messages=chat(url), max_tokens=2)
        assert out.usage.completion_tokens == 2
    else:
        with pytest.raises(openai.APIStatusError) as err:
            front.fetching.chat.completions.create(model=MODEL, messages=chat(url), max_tokens=2)
        assert err.value.status_code == status and needle in err.value.message
        assert err.value.type == "invalid_request_error"
    assert servers.off_list.dialled == dialled  # a host off the list is never dialled
