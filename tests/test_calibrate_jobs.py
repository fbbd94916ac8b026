"""``vlkv calibrate --jobs N``: the prompts' chunks in worker processes give the table one process gives, with
and without screening; a worker's error stops the run with a message naming the prompts, no worker left."""

from __future__ import annotations

import base64
import json
import multiprocessing

import pytest
import torch
from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.tools.calibrate import calibrate, chunk_phases
from vlkv.tools.cli import main

from tests.calib_prompts import synthetic_prompts

BUDGETS = (0.05, 0.1)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return synthetic_prompts(tmp_path_factory.mktemp("calibrate_jobs"), 3, seed=5)


def _run(prompts, tmp_path, name, jobs, **kw):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker: the same kernels, the same bits
    try:
        path, profile, _ = calibrate(
            str(DEFAULT_MODEL_DIR),
            str(prompts),
            BUDGETS,
            tokens=4,
            out=str(tmp_path / f"{name}.json"),
            chunk=1,
            trace=str(tmp_path / f"{name}.jsonl"),
            jobs=jobs,
            **kw,
        )
    finally:
        torch.set_num_threads(threads)
    return json.loads(path.read_text()), (tmp_path / f"{name}.jsonl").read_text()


def test_chunks_are_the_screening_ones_then_the_rest():
    assert chunk_phases(5, 5, 2) == [[(0, 2), (2, 4), (4, 5)]]
    assert chunk_phases(5, 3, 2) == [[(0, 2), (2, 3)], [(3, 5)]]


@pytest.mark.parametrize("screen", [0, 1])
def test_two_workers_give_the_table_of_one_process(prompts, tmp_path, screen):
    one, one_trace = _run(prompts, tmp_path, "one", 1, screen=screen, keep=2)
    two, two_trace = _run(prompts, tmp_path, "two", 2, screen=screen, keep=2)
    assert two["table"] == one["table"] and two["entries"] == one["entries"]
    assert two == one and two_trace == one_trace  # fingerprint, prompts, measure too
    counts = {r["prompts"] for r in one["table"]}
    assert counts == ({3} if not screen else {1, 3})
    assert not multiprocessing.active_children()


def test_two_workers_rerank_as_one_process(prompts, tmp_path):
    """``--rerank`` runs on the pool's workers: the same recalls, profile and trace as in one process, and
    only the first ``rerank_prompts`` prompts are decoded free-running."""
    one, one_trace = _run(prompts, tmp_path, "one", 1, rerank=2, rerank_prompts=2)
    two, two_trace = _run(prompts, tmp_path, "two", 2, rerank=2, rerank_prompts=2)
    assert two == one and two_trace == one_trace
    assert one["measure"]["rerank"] == 2 and one["measure"]["rerank_prompts"] == 2
    assert any("recall" in r for r in one["table"])
    lengths = [{len(v) for v in json.loads(line).values()} for line in one_trace.splitlines()]
    assert lengths[0] == lengths[1] == {2, 3} and lengths[2] == {2}  # the third prompt: not re-ranked
    assert not multiprocessing.active_children()


def test_a_workers_error_names_its_prompts_and_stops_every_worker(prompts, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = prompts.read_text().splitlines()
    broken = json.loads(lines[2])
    broken["images"] = [base64.b64encode(b"not an image at all").decode()]  # base64: read_prompts takes it
    bad.write_text("\n".join([*lines[:2], json.dumps(broken)]) + "\n")
    argv = ["calibrate", "--prompts", str(bad), "--budgets", "0.1", "-n", "4", "--chunk", "1", "--jobs", "2"]
    assert main([*argv, "--out", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err
    assert "vlkv calibrate: calibrate worker" in err and "failed at prompt 3:" in err
    assert not (tmp_path / "p.json").exists()
    assert not multiprocessing.active_children()
