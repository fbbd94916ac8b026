"""Tiny items for the worker pool's tests (``deploy/pool.py``): a worker's set-up, its work on an item, an item's
label, and ``scenario``, the parent a test starts in its own process (``python -c "from pool_scenario import
scenario; ..."``) to Ctrl-C or kill it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

from vlkv.deploy.pool import Pool


def set_up_worker(spec: dict) -> dict:
    if spec.get("fail_setup"):
        raise RuntimeError("no model here")
    return {"pid": os.getpid(), "lock": multiprocessing.Lock(), "setups": 1, **spec}


def run_item(item, state: dict, bar):
    """``("square", x)``, ``("sleep", s)``, ``("await", n)``, ``("fail", _)`` or ``("die", _)``; each started
    item leaves a file named for its worker's pid in ``state["pids"]`` (when set)."""
    if state.get("pids"):
        (Path(state["pids"]) / str(os.getpid())).touch()
    kind, x = item
    bar.update(2)
    if kind == "sleep":
        time.sleep(x)
    elif kind == "await":  # until x items have started (one file per worker), at most 60 s
        for _ in range(600):
            if len(list(Path(state["pids"]).iterdir())) >= x:
                break
            time.sleep(0.1)
    elif kind == "fail":
        raise ValueError(f"bad item {x}")
    elif kind == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return x * x, state["pid"], state["setups"]


def item_label(item) -> str:
    return f"item {item[0]} {item[1]}"


def scenario(pids: str, fail: bool) -> None:
    """A parent for the Ctrl-C and kill tests of tests/integration/test_pool.py: two workers asleep in an item;
    with ``fail``, one waits until the other has started its item (a worker slow to start up could otherwise miss
    the run: seen on a loaded 2-core machine), then fails the next item while the other sleeps on."""
    items = [("sleep", 120), ("await", 2), ("fail", 3)] if fail else [("sleep", 120), ("sleep", 120)]
    with Pool(2, run_item, set_up_worker, {"pids": pids}, label=item_label) as pool:
        pool.run(items)
