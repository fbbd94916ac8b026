"""Prometheus metrics of the gateway (the figures that drive scaling, and request outcomes).

Each gateway owns its own registry (so several can live in one test process); ``serve_metrics`` exposes
it over HTTP in the Prometheus text format.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from vlkv.common.compression.verify import budget_bucket

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Request figures are labelled by the public front that took the request: "grpc" or "http".
        front = ["front"]
        self.requests = Counter(
            "vlkv_requests", "requests by final status and front", ["status", "front"], registry=r
        )
        self.in_flight = Gauge("vlkv_requests_in_flight", "requests in progress", front, registry=r)
        self.ttft = Histogram(
            "vlkv_ttft_seconds", "time to first token", front, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vlkv_inter_token_seconds", "time between streamed tokens", front,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill = Histogram(
            "vlkv_prefill_seconds", "prefill forward + compression on a prefill worker",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.hand_off = Histogram(
            "vlkv_hand_off_seconds", "compact KV transfer prefill -> decode (as the prefill worker timed it)",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter("vlkv_generated_tokens", "tokens streamed to clients", front, registry=r)
        self.compression = Histogram(
            "vlkv_compression_ratio",
            "realized KV compression ratio per request",
            buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0),
            registry=r,
        )
        self.kv_bytes = Counter(
            "vlkv_kv_bytes_handed_over", "compact KV bytes sent prefill -> decode", registry=r
        )
        # Verified compression (docs/compression.md): per request, as its usage reports it
        self.verified_agreement = Histogram(
            "vlkv_verified_agreement",
            "draft agreement of the kept compressed cache, by requested budget (percent)",
            ["budget"],
            buckets=(0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0),
            registry=r,
        )
        self.budget_raises = Counter(
            "vlkv_budget_raises",
            "budget doublings to meet a request's fidelity floor",
            ["budget"],
            registry=r,
        )
        self.floor_misses = Counter(
            "vlkv_floor_misses",
            "requests served at the cap below their fidelity floor",
            ["budget"],
            registry=r,
        )
        self.candidate_wins = Counter(
            "vlkv_candidate_wins", "verified requests by the candidate kept", ["candidate"], registry=r
        )
        self.window_saved = Counter(
            "vlkv_kv_bytes_window_saved", "full-cache bytes sliding-window layers never kept", registry=r
        )
        self.hand_off_retries = Counter(
            "vlkv_hand_off_retries",
            "caches a decode worker refused for room, sent again elsewhere",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vlkv_prompt_tokens",
            "prompt tokens of finished requests by where their K/V came from: prefilled, prefix_cache, or (a "
            "conversation continue turn) continued over and retained_compressed in the last turn's cache",
            ["source"],
            registry=r,
        )
        self.kept_turns = Counter(
            "vlkv_kept_turns",
            "conversation continue turns on decode workers' kept caches: kept (a turn's cache kept for the next), "
            "continued (a turn decoded on one), gone (the worker had given it back: served the usual way)",
            ["event"],
            registry=r,
        )
        self.image_cache = Counter(
            "vlkv_image_cache_requests",
            "requests with images by prefill image-cache result (hit: every image reused)",
            ["result"],
            registry=r,
        )

        def per_worker(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, ["address", *labels], registry=r)

        self.image_cache_bytes = per_worker(
            "vlkv_image_cache_bytes", "bytes a prefill worker's image cache holds"
        )
        self.image_cache_events = per_worker(
            "vlkv_image_cache_events",
            "a prefill worker's image-cache lookups and evictions since it started",
            "event",
        )
        self.prefix_cache_bytes = per_worker(
            "vlkv_prefix_cache_bytes", "bytes a prefill worker's prefix cache holds"
        )
        self.prefix_cache_events = per_worker(
            "vlkv_prefix_cache_events",
            "a prefill worker's prefix-cache lookups, hits, tokens served and evictions since it started",
            "event",
        )
        labels = ["kind", "address"]
        self.worker_running = Gauge("vlkv_worker_running", "requests running on a worker", labels, registry=r)
        self.worker_waiting = Gauge("vlkv_worker_waiting", "requests queued on a worker", labels, registry=r)
        self.pool_occupancy = per_worker(
            "vlkv_decode_pool_occupancy", "share of a decode worker's KV blocks in use"
        )
        self.replicas = Gauge("vlkv_replicas", "workers serving, by kind", ["kind"], registry=r)
        self.admit_queue = Gauge(
            "vlkv_admission_queue", "requests waiting for a decode worker with KV room", registry=r
        )
        self.swapped = per_worker(
            "vlkv_decode_swapped", "sequences preempted to host memory on a decode worker"
        )
        self.preemptions = per_worker(
            "vlkv_decode_preemptions", "preemptions on a decode worker since it started"
        )
        self.pool_kv_bytes = per_worker(
            "vlkv_decode_kv_bytes",
            "bytes of a decode worker's KV pool (total) and of its blocks in use (used), in its kv dtype",
            "kv_dtype",
            "state",
        )
        # Remote image URLs of the HTTP front (services/image_fetch.py).
        self.image_fetches = Counter("vlkv_image_fetches", "remote image fetches started", registry=r)
        self.image_fetch_failures = Counter(
            "vlkv_image_fetch_failures",
            "remote image fetches that failed, by reason (timeout, too_large, status, connect, not_allowed, "
            "redirect_refused, redirects, scheme, cancelled)",
            ["reason"],
            registry=r,
        )
        self.image_fetch_seconds = Histogram(
            "vlkv_image_fetch_seconds", "time of a remote image fetch, success or not",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

    def record_prompt(self, usage) -> None:
        """How a finished request's prompt tokens got their K/V."""
        cached, continued, m = usage.cached_prompt_tokens, usage.continued_tokens, usage.prompt_tokens
        if usage.continued_on == "decode":  # the kept cache's positions, the rest fed by the decode worker
            self.prompt_tokens.labels("continued").inc(max(0, m - cached))
            self.prompt_tokens.labels("retained_compressed").inc(cached)
        elif continued:
            self.prompt_tokens.labels("continued").inc(continued)
            self.prompt_tokens.labels("retained_compressed").inc(max(0, m - continued))
        else:
            self.prompt_tokens.labels("prefilled").inc(max(0, m - cached))
            self.prompt_tokens.labels("prefix_cache").inc(cached)

    def record_verdict(self, usage, requested: float) -> None:
        """A finished request's verification figures (nothing when it was not verified), under its requested
        budget."""
        if not usage.verify:
            return
        bucket = budget_bucket(requested)
        self.verified_agreement.labels(bucket).observe(usage.verified_agreement)
        if usage.budget_raises:
            self.budget_raises.labels(bucket).inc(usage.budget_raises)
        if not usage.floor_met and usage.verify == "floor":
            self.floor_misses.labels(bucket).inc()
        self.candidate_wins.labels(usage.verified_candidate).inc()


def serve_metrics(metrics: GatewayMetrics, port: int, host: str = "127.0.0.1"):
    """Start the /metrics HTTP endpoint in a background thread; returns the HTTP server."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server


def record_loads(metrics: GatewayMetrics, router) -> None:
    """Export the loads the router last polled (the figures the autoscaler scales on)."""
    metrics.admit_queue.set(router.num_queued)
    for kind, pool in (("prefill", router.prefill), ("decode", router.decode)):
        metrics.replicas.labels(kind).set(len([w for w in pool.values() if not w.draining]))
        for w in pool.values():
            metrics.worker_running.labels(kind, w.address).set(w.load.running)
            metrics.worker_waiting.labels(kind, w.address).set(
                w.load.waiting + (w.in_flight if kind == "prefill" else 0)
            )
            if kind == "prefill" and w.load.HasField("image_cache"):
                ic = w.load.image_cache
                metrics.image_cache_bytes.labels(w.address).set(ic.bytes_held)
                for event in ("hits", "misses", "evictions"):
                    metrics.image_cache_events.labels(w.address, event).set(getattr(ic, event))
            if kind == "prefill" and w.load.HasField("prefix_cache"):
                pc = w.load.prefix_cache
                metrics.prefix_cache_bytes.labels(w.address).set(pc.bytes_held)
                for event in ("lookups", "hits", "hit_tokens", "lookup_tokens", "evictions", "rejected"):
                    metrics.prefix_cache_events.labels(w.address, event).set(getattr(pc, event))
            if kind == "decode" and w.load.total_blocks:
                metrics.pool_occupancy.labels(w.address).set(1 - w.load.free_blocks / w.load.total_blocks)
                metrics.swapped.labels(w.address).set(w.load.swapped)
                metrics.preemptions.labels(w.address).set(w.load.preemptions)
                if w.load.block_bytes:
                    for state, blocks in (
                        ("total", w.load.total_blocks),
                        ("used", w.load.total_blocks - w.load.free_blocks),
                    ):
                        metrics.pool_kv_bytes.labels(w.address, w.load.kv_dtype, state).set(
                            blocks * w.load.block_bytes
                        )
