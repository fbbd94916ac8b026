"""Request traces for ``vlkv simulate``: Poisson, bursty and diurnal arrivals with a prompt and image mix,
or a recorded trace (a ``vlkv``/``loadgen --json`` run's records) replayed as it happened.

The mix: prompt text tokens exponential around ``prompt_tokens``, ``images`` images per request with
probability ``image_share`` (each ``vision_tokens_per_image`` tokens), an image drawn from a popular set
of ``popular_images`` with probability ``image_reuse`` (else a fresh one), max_new_tokens uniform in
``[new_tokens/2, 3*new_tokens/2]``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from vlkv_lab.sim.workers import SimRequest

KINDS = ("poisson", "bursty", "diurnal")


@dataclass
class Mix:
    prompt_tokens: int = 48
    images: int = 1
    image_share: float = 1.0
    image_reuse: float = 0.3
    popular_images: int = 200
    new_tokens: int = 64
    tenants: int = 4


def rate_at(kind: str, t: float, rate: float, period_s: float) -> float:
    """Arrivals per second at ``t``: ``rate`` (poisson); bursts of 3x for a fifth of each period and 0.5x
    between (the same mean, bursty); a 10x swing between night and noon around ``rate`` (diurnal)."""
    if kind == "poisson":
        return rate
    phase = (t % period_s) / period_s
    if kind == "bursty":
        return rate * (3.0 if phase < 0.2 else 0.5)
    low = 2 * rate / 11  # min .. 10*min, mean 5.5*min = rate
    return low * (1 + 9 * (1 - math.cos(2 * math.pi * phase)) / 2)


def peak_rate(kind: str, rate: float) -> float:
    return {"poisson": rate, "bursty": 3 * rate, "diurnal": 20 * rate / 11}[kind]


def generate(
    kind: str, rate: float, duration_s: float, mix: Mix, vision_tokens_per_image: int, seed: int = 0,
    period_s: float = 60.0,
) -> list[SimRequest]:  # fmt: skip
    """Arrivals over ``duration_s`` (a thinned Poisson process for the time-varying kinds)."""
    rng = random.Random(seed)
    top = peak_rate(kind, rate)
    out: list[SimRequest] = []
    t, fresh = 0.0, 0
    while True:
        t += rng.expovariate(top)
        if t >= duration_s:
            return out
        if rng.random() * top > rate_at(kind, t, rate, period_s):
            continue
        images: list[str] = []
        if rng.random() < mix.image_share:
            for _ in range(mix.images):
                if rng.random() < mix.image_reuse:
                    images.append(f"popular-{rng.randrange(mix.popular_images)}")
                else:
                    fresh += 1
                    images.append(f"fresh-{fresh}")
        text = max(1, int(rng.expovariate(1 / mix.prompt_tokens)))
        vision = vision_tokens_per_image * len(images)
        new = rng.randint(max(1, mix.new_tokens // 2), max(1, 3 * mix.new_tokens // 2))
        tenant = f"tenant-{rng.randrange(mix.tenants)}"
        out.append(SimRequest(len(out), t, text + vision, vision, new, tuple(images), tenant))


def replay(path: str | Path) -> tuple[list[SimRequest], dict]:
    """A recorded run (``loadgen --json``): each request at its start time with its prompt, vision and
    generated tokens; returns the requests and the run's own summary (for the comparison)."""
    data = json.loads(Path(path).read_text())
    out = []
    for r in sorted(data["records"], key=lambda r: r["start"]):
        if r.get("status", "OK") != "OK":
            continue
        new = max(1, r.get("tokens") or r.get("generated_tokens") or 1)  # the tokens the client received
        images = tuple(f"rec-{r['index']}-{i}" for i in range(1 if r.get("vision_tokens") else 0))
        out.append(
            SimRequest(len(out), r["start"], r["prompt_tokens"], r.get("vision_tokens", 0), new, images)
        )
    return out, data.get("summary", {})
