"""``vlkv calibrate --jobs N``: the prompts' chunks in worker processes give the table one process gives, with
and without screening; a worker's error stops the run with a message naming the prompts, no worker left."""

from __future__ import annotations

import base64
import json
import multiprocessing

import pytest
import torch
from calib_prompts import synthetic_prompts
from vlkv.common.config import DEFAULT_MODEL_DIR, Limits, ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.calibrate import jobs as calibrate_jobs
from vlkv.deploy.calibrate import measure as calibrate_module
from vlkv.deploy.calibrate.answers import generation_suffix
from vlkv.deploy.calibrate.measure import (
    CANDIDATES,
    DEFAULT_RERANK,
    Calibration,
    _examples,
    _RenderedTask,
    calibrate,
    chunk_phases,
    keep_for_rerank,
    measure_chunk,
    rerank_chunk,
)
from vlkv.deploy.calibrate.prompts import read_prompts
from vlkv.deploy.cli.main import main
from vlkv_lab.eval.evaluation import prepare

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
            chunk=kw.pop("chunk", 1),
            rerank=kw.pop("rerank", 0),
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
    # a screening's chunks: about equal, a multiple of the workers (no worker idle before the cut)
    assert chunk_phases(100, 10, 8, 2) == [
        [(0, 5), (5, 10)],
        [(a, min(a + 8, 100)) for a in range(10, 100, 8)],
    ]
    assert chunk_phases(100, 10, 4, 2)[0] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert chunk_phases(20, 3, 8, 4)[0] == [(0, 1), (1, 2), (2, 3)]  # never an empty chunk
    assert chunk_phases(5, 5, 2, 2) == [[(0, 2), (2, 4), (4, 5)]]  # without a screening: as before


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


def test_rerank_4_is_the_default_and_0_turns_it_off():
    import inspect

    from vlkv.deploy.cli.main import main as cli_main

    seen: list[int] = []

    def parsed(args) -> int:  # the parsed flags, no calibration
        seen.append(args.rerank)
        return 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("vlkv.deploy.calibrate.command.cmd_calibrate", parsed)
        cli_main(["calibrate", "--prompts", "p.jsonl"])
        cli_main(["calibrate", "--prompts", "p.jsonl", "--rerank", "0"])
    assert seen == [DEFAULT_RERANK, 0] and DEFAULT_RERANK == 4
    assert inspect.signature(calibrate).parameters["rerank"].default == DEFAULT_RERANK


def test_screening_is_on_by_default_and_screen_0_turns_it_off():
    import inspect

    from vlkv.deploy.calibrate.measure import DEFAULT_KEEP, DEFAULT_SCREEN
    from vlkv.deploy.cli.main import main as cli_main

    seen: list[tuple[int, int]] = []

    def parsed(args) -> int:
        seen.append((args.screen, args.keep))
        return 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("vlkv.deploy.calibrate.command.cmd_calibrate", parsed)
        cli_main(["calibrate", "--prompts", "p.jsonl"])
        cli_main(["calibrate", "--prompts", "p.jsonl", "--screen", "0"])
    assert seen == [(DEFAULT_SCREEN, DEFAULT_KEEP), (0, DEFAULT_KEEP)] and DEFAULT_SCREEN > 0
    params = inspect.signature(calibrate).parameters
    assert (params["screen"].default, params["keep"].default) == (DEFAULT_SCREEN, DEFAULT_KEEP)


def test_the_rerank_pass_prefills_no_prompt_twice(prompts, tmp_path, monkeypatch):
    """The re-ranked prompts' prefills are the measure pass's, kept in the worker (``--jobs 1``: this
    process, so every prefill is counted here): each prompt prefilled once, with and without screening."""
    prefilled: list[str] = []

    def counting(model, processor, examples, **kw):
        prefilled.extend(e.name for e in examples)
        return prepare(model, processor, examples, **kw)

    monkeypatch.setattr(calibrate_jobs, "prepare", counting)
    monkeypatch.setattr(calibrate_module, "prepare", counting)
    for screen in (0, 1):  # screen 1, chunk 2: the rerank chunk (0, 2) spans prompts of both phases
        prefilled.clear()
        kw = {"rerank": 1, "rerank_prompts": 3, "screen": screen, "chunk": 2}
        profile, _ = _run(prompts, tmp_path, f"count{screen}", 1, **kw)
        assert profile["measure"]["rerank_prompts"] == 3
        assert sorted(prefilled) == sorted(set(prefilled)) and len(prefilled) == 3


def test_recalls_from_kept_prefills_equal_a_new_prefills(prompts):
    """``rerank_chunk`` on the measure pass's prefills (``keep_for_rerank``: the queries freed, the statistics
    and draft kept) gives the recalls of the old path, which prefilled the prompts again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(ModelConfig(path=str(DEFAULT_MODEL_DIR), dtype="float32"))
        processor = load_processor(str(DEFAULT_MODEL_DIR))
        requests, _ = read_prompts(str(prompts))
        examples = list(_examples(requests, processor, Limits()))
        prepared = prepare(
            model, processor, examples, progress=False, task=_RenderedTask, next_attention=False
        )
        measure_chunk(model, prepared, BUDGETS, 8, Calibration())
        for p in prepared:
            keep_for_rerank(p)
            assert p.q == []
        chosen = {b: {label for label, _ in CANDIDATES[::3]} for b in BUDGETS}
        args = (model, processor, generation_suffix(processor), requests, BUDGETS, 8, chosen)
        kept = rerank_chunk(*args, kept=prepared)
        again = rerank_chunk(*args)  # the old path: every prompt prefilled here
        mixed = rerank_chunk(*args, kept=[prepared[0], None, prepared[2]])
    finally:
        torch.set_num_threads(threads)
    assert kept == again == mixed and len(kept) == 3 and len(kept[0]) == len(chosen[0.05]) * 2


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


def test_the_bar_counts_a_measured_prompt_as_measure_steps_and_a_re_ranked_one_as_one(
    prompts, tmp_path, monkeypatch
):
    """The ETA weighs the two passes by their cost: the bar's total is ``MEASURE_STEPS`` per prompt plus one per
    re-ranked prompt, and the run ends exactly there."""
    bars: list[calibrate_jobs.Progress] = []

    class Recording(calibrate_jobs.Progress):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "disable": True})
            bars.append(self)

    monkeypatch.setattr(calibrate_jobs, "Progress", Recording)
    _run(prompts, tmp_path, "steps", 1, rerank=1, rerank_prompts=2)
    (bar,) = bars
    assert calibrate_jobs.MEASURE_STEPS > 1
    assert bar.total == bar.n == calibrate_jobs.MEASURE_STEPS * 3 + 2
