"""``vlkv simulate``'s figures: one row per run (a table), and a plot of the runs over time."""

from __future__ import annotations

from vlkv_lab.loadgen import percentile
from vlkv_lab.sim.cluster import SimResult

FLAP_S = 120.0  # a worker started and drained within this is an oscillation


def _hist_percentile(hist: dict[int, int], q: float) -> float:
    """Percentile of a histogram keyed by 0.1 ms, in seconds."""
    total = sum(hist.values())
    if not total:
        return float("nan")
    want, seen = total * q / 100, 0
    for k in sorted(hist):
        seen += hist[k]
        if seen >= want:
            return k / 1e4
    return max(hist) / 1e4


def flaps(events) -> int:
    """Workers started and then drained within FLAP_S."""
    up = {e.address: e.at for e in events if e.action == "up"}
    return sum(1 for e in events if e.action == "drain" and e.address in up and e.at - up[e.address] < FLAP_S)


def summarize(res: SimResult) -> dict:
    cfg = res.cfg
    counted = [r for r in res.requests if r.arrival >= cfg.warmup_s]
    ok = [r for r in counted if r.status == "OK"]
    ttft = [r.ttft for r in ok]
    samples = [s for s in res.samples if s.t >= cfg.warmup_s] or res.samples
    done = [r for r in res.requests if r.status == "OK"]
    return {
        "run": cfg.label,
        "decode": cfg.decode,
        "prefill": cfg.prefill,
        "strategy": cfg.strategy,
        "requests": len(res.requests),
        "lost": sum(r.status != "OK" for r in res.requests),
        "refusals": sum(r.refusals for r in res.requests),
        "queued_share": sum(r.queued for r in counted) / max(1, len(counted)),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": _hist_percentile(res.itl, 50),
        "itl_p99_s": _hist_percentile(res.itl, 99),
        "tokens_s": res.tokens / res.sim_s if res.sim_s else 0.0,
        "requests_s": len(done) / res.sim_s if res.sim_s else 0.0,
        "occupancy_mean": sum(s.occupancy for s in samples) / max(1, len(samples)),
        "queue_mean": sum(s.queued for s in samples) / max(1, len(samples)),
        "queue_max": max((s.queued for s in samples), default=0),
        "scale_ups": sum(e.action == "up" for e in res.events),
        "drains": sum(e.action == "drain" for e in res.events),
        "flaps": flaps(res.events),
        "decode_max_seen": max((s.decode for s in res.samples), default=cfg.decode),
        "router_cpu_us_per_req": res.router_cpu_ns / 1e3 / max(1, len(res.requests)),
        "pick_cpu_us_per_req": res.pick_cpu_ns / 1e3 / max(1, len(res.requests)),
        "sim_s": res.sim_s,
        "wall_s": res.wall_s,
    }


COLUMNS = [
    ("run", "run", "{}"),
    ("decode", "decode", "{}"),
    ("prefill", "prefill", "{}"),
    ("strategy", "routing", "{}"),
    ("requests", "requests", "{}"),
    ("lost", "lost", "{}"),
    ("refusals", "refused", "{}"),
    ("ttft_p50_s", "TTFT p50 ms", "{:.0f}", 1e3),
    ("ttft_p99_s", "TTFT p99 ms", "{:.0f}", 1e3),
    ("itl_p50_s", "ITL p50 ms", "{:.1f}", 1e3),
    ("itl_p99_s", "ITL p99 ms", "{:.1f}", 1e3),
    ("tokens_s", "tok/s", "{:.0f}"),
    ("occupancy_mean", "pool occ", "{:.0%}"),
    ("queue_mean", "queue mean", "{:.1f}"),
    ("queue_max", "queue max", "{}"),
    ("scale_ups", "ups", "{}"),
    ("drains", "drains", "{}"),
    ("flaps", "flaps<2min", "{}"),
    ("router_cpu_us_per_req", "router CPU us/req", "{:.0f}"),
    ("pick_cpu_us_per_req", "of it picks", "{:.0f}"),
    ("sim_s", "sim s", "{:.0f}"),
    ("wall_s", "wall s", "{:.0f}"),
]


def table(rows: list[dict]) -> str:
    heads = [c[1] for c in COLUMNS]
    cells = []
    for row in rows:
        line = []
        for c in COLUMNS:
            v = row[c[0]]
            if len(c) > 3:
                v = v * c[3]
            line.append(c[2].format(v))
        cells.append(line)
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(heads)]
    out = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    out += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def plot(results: list[SimResult], path: str) -> None:
    """Per run over virtual time: arrivals, TTFT p99 per 5 s, queue, pool occupancy, decode workers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for res in results:
        label = res.cfg.label
        ts = [s.t for s in res.samples]
        axes[0][0].plot(ts, [s.rate for s in res.samples], label=label)
        window: dict[int, list[float]] = {}
        for r in res.requests:
            if r.status == "OK":
                window.setdefault(int(r.arrival // 5), []).append(r.ttft)
        keys = sorted(window)
        axes[0][1].plot([k * 5 for k in keys], [percentile(window[k], 99) * 1e3 for k in keys], label=label)
        axes[1][0].plot(ts, [s.occupancy for s in res.samples], label=label)
        axes[1][1].plot(ts, [s.decode for s in res.samples], label=label)
    titles = ["arrivals / s", "TTFT p99 (ms) per 5 s of arrivals", "decode pool occupancy", "decode workers"]
    for ax, title in zip([a for row in axes for a in row], titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("simulated s")
        ax.grid(alpha=0.3)
    axes[0][1].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
