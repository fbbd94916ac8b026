"""How loaded this box is by other work, as the kernel shares it: with autogroup scheduling (``/proc/sys/
kernel/sched_autogroup_enabled``, on here) the cores are shared fairly between sessions that have work to
run (each core's run queue between the sessions on it), whatever their thread counts and nice values, and
only then between a session's threads. So the load that slows our deployment is the number of other
sessions with a runnable thread (``other_groups``); ``cpu.py`` turns it into our session's share.
Also the CPU time a set of process trees has used (``tree_cpu_s``: ``vlkv profile`` measures the CPU a
request costs beyond its critical path).

    python -m vlkv_lab.sim.box_load --out load.jsonl   # until SIGINT/SIGTERM: {t, others} per sample
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> list[str] | None:
    """A /proc stat line's fields after the command name (field 3, the state, first)."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses


def _parents() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (f := _stat(f"/proc/{name}/stat")) is not None:
            out[int(name)] = int(f[1])
    return out


def _group(pid: int | str) -> str:
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return ""


def other_groups(own: str | None = None) -> int:
    """Sessions (autogroups) other than ``own`` (default: this process's) with a runnable thread now."""
    own = _group("self") if own is None else own
    groups = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{name}/task")
        except OSError:
            continue
        if any((f := _stat(f"/proc/{name}/task/{t}/stat")) is not None and f[0] == "R" for t in tids):
            g = _group(name)
            if g and g != own:
                groups.add(g)
    return len(groups)


def tree_cpu_s(roots: set[int]) -> float:
    """User + system CPU seconds used so far by the live processes of the trees rooted at ``roots``."""
    parent = _parents()
    total = 0
    for pid in parent:
        if outside({pid: 1}, parent, roots) == 0 and (f := _stat(f"/proc/{pid}/stat")) is not None:
            total += int(f[11]) + int(f[12])
    return total / _TICK


def outside(running: dict[int, float], parent: dict[int, int], exclude_roots: set[int]) -> float:
    """Of ``running`` (pid -> runnable threads), those of processes outside the trees of ``exclude_roots``
    (``parent``: pid -> parent pid)."""
    total = 0
    for pid, n in running.items():
        p, seen = pid, 0
        while p > 1 and p not in exclude_roots and seen < 64:
            p, seen = parent.get(p, 0), seen + 1
        total += 0 if p in exclude_roots else n
    return total


class BoxLoad:
    """Samples ``other_groups`` every ``every_s`` in a thread (``with BoxLoad() as b``; ``b.mean()``)."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []  # (unix time, other sessions with runnable threads)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append((time.time(), other_groups()))

    def __enter__(self) -> BoxLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def mean(self, since: float = 0.0) -> float:
        xs = [n for t, n in self.samples if t >= since]
        return statistics.mean(xs) if xs else 0.0


def load_series(path: str | Path, start_unix: float) -> list[tuple[float, float]]:
    """A recorded series (this module's ``--out``) as (seconds since ``start_unix``, threads)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(r["t"] - start_unix, float(r["others"])) for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlkv_lab.sim.box_load", description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    p.add_argument("--out", required=True, help="JSON lines: {t: unix time, others: runnable threads}")
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with open(args.out, "a") as f:
        while not stop.wait(args.every):
            f.write(json.dumps({"t": time.time(), "others": other_groups()}) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
