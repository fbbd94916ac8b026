"""``vlkv simulate`` on a small cluster: the real router and autoscaler over simulated workers serve every
request of a trace; the autoscaler grows the decode pool under load and, with ``min_uptime_s``, drains
no worker it started within that time."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
from vlkv_lab.sim import trace, vclock
from vlkv_lab.sim.box_load import load_series, outside
from vlkv_lab.sim.cluster import SimConfig, Simulation, capacity
from vlkv_lab.sim.cpu import Dedicated, SharedCPU
from vlkv_lab.sim.measure import _fit_nonneg
from vlkv_lab.sim.profile import Profile
from vlkv_lab.sim.report import flaps, summarize


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


def test_a_shared_cpu_slows_concurrent_work_down():
    """Processor sharing: work measured alone takes its time alone; on 1 core two jobs take twice as long;
    on 2 cores three jobs share two; other busy sessions slow every job alike, from when they appear."""

    async def finish_times(cpu, jobs: list[tuple[float, float]]) -> list[float]:
        loop = asyncio.get_running_loop()
        t0, ends = loop.time(), [0.0] * len(jobs)

        async def one(i: int, start: float, work: float) -> None:
            await asyncio.sleep(start)
            await cpu.run(work)
            ends[i] = loop.time() - t0

        await asyncio.gather(*(one(i, s, w) for i, (s, w) in enumerate(jobs)))
        return ends

    def run(cpu, jobs):
        return vclock.run(finish_times(cpu, jobs))

    assert run(SharedCPU(1), [(0, 1.0)]) == pytest.approx([1.0])
    assert run(SharedCPU(1), [(0, 1.0), (0, 1.0)]) == pytest.approx([2.0, 2.0])
    assert run(SharedCPU(2), [(0, 1.0), (0, 1.0)]) == pytest.approx([1.0, 1.0])
    # a job joining half-way: the first has 0.5 s of work left, done at half speed
    assert run(SharedCPU(1), [(0, 1.0), (0.5, 1.0)]) == pytest.approx([1.5, 2.0])
    assert run(SharedCPU(2, background=2), [(0, 1.0), (0, 1.0)]) == pytest.approx([1.0, 1.0])
    assert run(SharedCPU(2, background=0), [(0, 1.0), (0, 1.0), (0, 1.0)]) == pytest.approx([1.5] * 3)

    async def busier_half_way(cpu):  # 2 busy sessions, then 6: our share of a core from 1/2 to 1/4
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, cpu.set_background, 6)
        await cpu.run(1.0)
        return loop.time()

    assert vclock.run(busier_half_way(SharedCPU(2, background=2))) == pytest.approx(1.5)
    assert run(Dedicated(), [(0, 1.0), (0, 1.0)]) == pytest.approx([1.0, 1.0])


def test_the_gateway_validation_and_a_shared_cpu_lengthen_time_to_first_token():
    mix = trace.Mix(new_tokens=16)
    base = replace(_profile(), prefill_base_s=0.2, step_s=[0.01] * 4)
    reqs = trace.generate("poisson", 2.0, 20.0, mix, base.vision_tokens_per_image, seed=3)
    rows = {}
    for name, prof in (
        ("alone", base),
        ("validated", replace(base, prep_base_s=0.05)),
        ("shared", replace(base, prep_base_s=0.05, shared_cores=1.0)),
    ):
        cfg = SimConfig(decode=2, prefill=1, label=name, warmup_s=0.0)
        rows[name] = summarize(vclock.run(Simulation(cfg, prof, [replace(r) for r in reqs]).run()))
        assert rows[name]["lost"] == 0
    assert rows["alone"]["ttft_p50_s"] < rows["validated"]["ttft_p50_s"] < rows["shared"]["ttft_p50_s"]


def test_box_load_counts_only_threads_outside_our_process_trees(tmp_path):
    parent = {10: 1, 11: 10, 12: 11, 20: 1, 21: 20}  # 10 -> 11 -> 12 is ours; 20 -> 21 is not
    running = {11: 2, 12: 1, 21: 3, 20: 1}
    assert outside(running, parent, {10}) == 4
    assert outside(running, parent, {11}) == 4
    assert outside(running, parent, {10, 20}) == 0
    assert outside(running, parent, set()) == 7
    path = tmp_path / "box.jsonl"
    path.write_text('{"t": 100.5, "others": 3}\n{"t": 101.0, "others": 5}\n')
    assert load_series(path, 100.0) == [(0.5, 3.0), (1.0, 5.0)]


def test_profile_fits_never_give_a_negative_cost():
    a = np.array([[1.0, 34, 576], [1.0, 110, 576], [1.0, 34, 1152]])
    exact = np.array([0.01, 1e-4, 2e-4])
    assert _fit_nonneg(a, a @ exact) == pytest.approx(exact)
    noisy = np.array([0.08, 0.07, 0.15])  # more text made it faster: that column is left out
    coef = _fit_nonneg(a, noisy)
    assert (coef >= 0).all() and coef[1] == 0.0
    assert a @ coef == pytest.approx(noisy, abs=0.01)
