"""``vlkv simulate`` on a small cluster: the real router and autoscaler over simulated workers serve every
request of a trace; the autoscaler grows the decode pool under load and, with ``min_uptime_s``, drains
no worker it started within that time."""

from __future__ import annotations

from vlkv.tools.sim import trace, vclock
from vlkv.tools.sim.cluster import SimConfig, Simulation, capacity
from vlkv.tools.sim.profile import Profile
from vlkv.tools.sim.report import flaps, summarize


def _profile() -> Profile:
    return Profile(pool_blocks=256, max_batch=8, worker_start_s=2.0)


def test_every_request_is_served_and_routing_strategies_run():
    prof = _profile()
    mix = trace.Mix(new_tokens=32)
    rate, prefill = capacity(prof, mix, 3)
    for strategy in ("kv", "round_robin"):
        reqs = trace.generate("poisson", 0.8 * rate, 5.0, mix, prof.vision_tokens_per_image, seed=1)
        cfg = SimConfig(decode=3, prefill=prefill, strategy=strategy, gateways=2, label=strategy)
        row = summarize(vclock.run(Simulation(cfg, prof, reqs).run()))
        assert row["requests"] == len(reqs) > 20
        if strategy == "kv":
            assert row["lost"] == 0 and row["tokens_s"] > 0 and row["router_cpu_us_per_req"] > 0


def test_autoscaler_follows_a_burst_without_flapping():
    prof = _profile()
    mix = trace.Mix(new_tokens=32)
    rate, _ = capacity(prof, mix, 4)
    reqs = trace.generate("bursty", 0.5 * rate, 60.0, mix, prof.vision_tokens_per_image, seed=2, period_s=60)
    cfg = SimConfig(
        decode=1,
        prefill=2,
        autoscale=True,
        decode_max=6,
        prefill_max=8,
        downscale_delay_s=5,
        min_uptime_s=120,
    )
    res = vclock.run(Simulation(cfg, prof, reqs).run())
    assert any(e.action == "up" and e.kind == "decode" for e in res.events)
    assert flaps(res.events) == 0
    assert all(r.status == "OK" for r in res.requests)
