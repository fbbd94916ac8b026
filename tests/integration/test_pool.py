"""The tools' one worker pool (``deploy/pool.py``) on tiny items, no model: results in the order given, one
setup per worker across batches; a failed item, a failed setup or a dead worker stops every worker and names
the item; Ctrl-C and a killed parent leave no worker; and no "leaked semaphore" after a failure or Ctrl-C
although every worker holds a multiprocessing lock (as tqdm makes one)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pool_scenario import item_label, run_item, set_up_worker
from vlkv.deploy.pool import START_UP, Pool, WorkerFailed
from vlkv.deploy.progress import Progress

ROOT = Path(__file__).resolve().parents[2]


def test_an_item_sent_to_a_worker_runs_there_and_placed_says_where():
    bar = Progress(total=0, disable=True)
    with Pool(2, run_item, set_up_worker, {}, bar=bar, label=item_label) as pool:
        first = pool.run([("square", 1), ("square", 2), ("square", 3)])
        pid = {w: p.pid for w, p in enumerate(pool.procs)}
        assert [pid[w] for w in pool.placed] == [r[1] for r in first]
        # every item to worker 1, then one to worker 0 last: worker 0 does not take worker 1's items
        items = [("sleep", 0.2), ("square", 4), ("square", 5), ("square", 6)]
        second = pool.run(items, to=[1, 1, 1, 0])
        assert [r[1] for r in second] == [pid[1], pid[1], pid[1], pid[0]] and pool.placed == [1, 1, 1, 0]
        with pytest.raises(ValueError, match="one worker in 0..1"):
            pool.run([("square", 1)], to=[2])
    assert [r[0] for r in second[1:]] == [16, 25, 36]


def test_two_batches_keep_their_order_and_one_setup_per_worker():
    bar = Progress(total=0, disable=True)
    with Pool(2, run_item, set_up_worker, {}, bar=bar, label=item_label) as pool:
        first = pool.run([("sleep", 0.3), ("square", 2), ("square", 3)])
        seen: list[int] = []
        second = pool.run([("square", 4), ("square", 5)], on_result=lambda i, r: seen.append(i))
        procs = list(pool.procs)
    assert [r[0] for r in first] == [0.09, 4, 9] and [r[0] for r in second] == [16, 25]
    assert sorted(seen) == [0, 1]
    pids = {r[1] for r in first + second}
    assert pids <= {p.pid for p in procs} and all(r[2] == 1 for r in first + second)
    assert bar.n == 2 * 5  # every item's steps reached the parent's bar
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("items", "spec", "where", "cause"),
    [
        ([("sleep", 60), ("fail", 7)], {}, "item fail 7", "ValueError: bad item 7"),
        ([("sleep", 60), ("die", 1)], {}, "item die 1", f"exited with code {-signal.SIGKILL}"),
        ([("square", 1)], {"fail_setup": True}, START_UP, "RuntimeError: no model here"),
    ],
)
def test_a_failure_stops_every_worker_and_names_the_item(items, spec, where, cause):
    with pytest.raises(WorkerFailed) as exc, Pool(2, run_item, set_up_worker, spec, label=item_label) as pool:
        pool.run(items)
    assert exc.value.item == where and cause in str(exc.value)
    assert exc.value.worker in (0, 1) and str(exc.value).startswith(f"worker {exc.value.worker} failed at")
    assert not any(p.is_alive() for p in pool.procs) and not multiprocessing.active_children()


def _start(tmp_path: Path, fail: bool = False) -> tuple[subprocess.Popen, Path]:
    pids = tmp_path / "pids"
    pids.mkdir()
    # Ctrl-C as in a terminal: a suite started in the background by a shell without job control (`cmd &`)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler (the scenario slept on).
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"from pool_scenario import scenario; scenario({str(pids)!r}, {fail})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "tests")),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, pids


def _workers(pids: Path, count: int) -> list[int]:
    """The workers' pids once ``count`` items have started (one file per worker)."""
    for _ in range(600):
        found = [int(p.name) for p in pids.iterdir()]
        if len(found) >= count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{count} items never started")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def _finish(proc: subprocess.Popen, pids: Path) -> str:
    """The scenario's stderr once it and every process holding its stderr exited; on a timeout, the process
    group is killed and the failure says what was still alive and where (the parent, each worker)."""
    try:
        return proc.communicate(timeout=100)[1]
    except subprocess.TimeoutExpired:
        alive = [proc.pid] + [int(p.name) for p in pids.iterdir()]
        states = {pid: _state(pid) for pid in alive}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        err = proc.communicate()[1]
        raise AssertionError(
            f"the scenario did not end in 100 s; processes {states}; stderr:\n{err}"
        ) from None


def _state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return "gone"
    return f"{next(line for line in status if line.startswith('State:'))} wchan={wchan}"


@pytest.mark.timeout(120)
def test_a_failure_in_a_real_run_leaks_no_semaphore(tmp_path):
    proc, pids = _start(tmp_path, fail=True)
    err = _finish(proc, pids)  # its stderr closes once the workers and the tracker are gone too
    assert proc.returncode == 1
    assert "WorkerFailed: worker" in err and "failed at item fail 3: ValueError: bad item 3" in err
    assert "leaked" not in err and all(_gone(pid) for pid in _workers(pids, 2))


@pytest.mark.timeout(120)
def test_ctrl_c_leaves_no_worker_and_no_leaked_semaphore(tmp_path):
    proc, pids = _start(tmp_path)
    workers = _workers(pids, 2)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    err = _finish(proc, pids)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert "leaked" not in err and all(_gone(pid) for pid in workers)


@pytest.mark.timeout(120)
def test_workers_stop_when_their_parent_is_killed(tmp_path):
    proc, pids = _start(tmp_path)
    workers = _workers(pids, 2)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to stop them
    err = _finish(proc, pids)  # returns once every worker closed its stderr: they exited
    assert proc.returncode == -signal.SIGKILL
    assert "leaked" not in err and all(_gone(pid) for pid in workers)
