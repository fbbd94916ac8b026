"""Service-time profile of one machine: what a simulated worker takes for each piece of work.

Measured by ``vlkv profile`` (``lab/vlkv_lab/sim/measure.py``) and saved as a small JSON file, so a profile from a GPU
machine can be dropped in later (``vlkv simulate --profile gpu.json``). ``DEFAULT_PROFILE`` is this repo's
CPU machine.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_PROFILE = Path(__file__).with_name("profile_cpu.json")


@dataclass
class Profile:
    machine: str = "unmeasured"
    # prefill seconds = base + per_token * prompt tokens + per_vision_token * vision tokens (a miss),
    # image-cache hits pay hit_vision_share of their vision tokens' part
    prefill_base_s: float = 0.02
    prefill_per_token_s: float = 1e-4
    prefill_per_vision_token_s: float = 1e-4
    hit_vision_share: float = 0.3
    vision_tokens_per_image: int = 16
    # decode step seconds at batch sizes step_batches (linear in between, the last slope beyond)
    step_batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    step_s: list[float] = field(default_factory=lambda: [0.010, 0.011, 0.013, 0.017])
    step_per_kv_mb_s: float = 0.0  # extra step time per MB of KV the batch holds
    # hand-off seconds = base + per_mb * MB of compact cache
    handoff_base_s: float = 0.002
    handoff_per_mb_s: float = 0.002
    # the model's cache: layers, bytes per token per layer (K and V), share of tokens kept by compression
    layers: int = 4
    token_bytes_per_layer: int = 1024
    kv_keep: float = 0.3
    # a decode worker's pool and batch (admission "reserve": a cache takes its max_new_tokens at once)
    block_size: int = 16
    pool_blocks: int = 2048
    max_batch: int = 64
    worker_start_s: float = 20.0  # from start to serving (model load)
    rpc_s: float = 0.0005  # one internal call's latency (GetLoad, a report's trip)
    # the gateway's validation of a request (image decoding, the processor) before it is routed:
    # base + per vision token, on up to prep_threads requests at once
    prep_base_s: float = 0.0
    prep_per_vision_token_s: float = 0.0
    prep_threads: int = 4
    # one box: the gateway and every worker share shared_cores cores (0: each worker has its own device),
    # beside background_threads other busy sessions while the profile was taken (cpu.py); a request also
    # costs overhead_s of CPU off its critical path (streaming, the client), run beside it
    shared_cores: float = 0.0
    background_threads: float = 0.0
    overhead_s: float = 0.0
    notes: str = ""

    def prefill_s(self, prompt_tokens: int, vision_tokens: int, hit_vision_tokens: int = 0) -> float:
        miss = vision_tokens - hit_vision_tokens
        vision = self.prefill_per_vision_token_s * (miss + self.hit_vision_share * hit_vision_tokens)
        return self.prefill_base_s + self.prefill_per_token_s * (prompt_tokens - vision_tokens) + vision

    def prep_s(self, vision_tokens: int) -> float:
        return self.prep_base_s + self.prep_per_vision_token_s * vision_tokens if self.prep_base_s else 0.0

    def step(self, batch: int, kv_mb: float = 0.0) -> float:
        xs, ys = self.step_batches, self.step_s
        if batch <= xs[0]:
            t = ys[0]
        else:
            i = min(bisect.bisect_left(xs, batch), len(xs) - 1)
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            t = y0 + (y1 - y0) * (batch - x0) / (x1 - x0)
        return max(t, 1e-6) + self.step_per_kv_mb_s * kv_mb

    def handoff_s(self, nbytes: int) -> float:
        return self.handoff_base_s + self.handoff_per_mb_s * nbytes / 1e6

    def layer_tokens(self, prompt_tokens: int) -> list[int]:
        """The compressed cache's tokens per layer (what the gateway estimates before routing)."""
        return [max(1, math.ceil(prompt_tokens * self.kv_keep))] * self.layers

    def kv_bytes(self, prompt_tokens: int) -> int:
        return sum(self.layer_tokens(prompt_tokens)) * self.token_bytes_per_layer

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PROFILE) -> Profile:
        return cls(**json.loads(Path(path).read_text()))
