"""``vlkv eval zoo --jobs N`` (the tools' one pool, ``deploy/pool.py``): worker processes give the serial
run's results in its order, and an item that fails in its worker stops the run with its name and error,
leaving no worker."""

from __future__ import annotations

import json
import multiprocessing
from types import SimpleNamespace

import pytest
import torch
from vlkv.deploy.jobs import auto_jobs, parse_jobs
from vlkv_lab.eval.zoo import run_zoo


def _args(out, jobs, members, **kw) -> SimpleNamespace:
    return SimpleNamespace(
        n=2, seed=0, split="heldout", members=members, out=str(out), ablation=False, jobs=jobs, **kw
    )


def test_jobs_parses_auto_as_at_most_two_workers_and_refuses_zero():
    assert parse_jobs("auto") == auto_jobs() and 1 <= auto_jobs() <= 2
    assert parse_jobs("3") == 3 and parse_jobs(1) == 1
    with pytest.raises(ValueError, match="--jobs"):
        parse_jobs("0")


@pytest.mark.timeout(300)
def test_two_workers_give_the_serial_runs_results_in_its_order(tmp_path):
    members = "grid16,default"  # the run sorts the items by cost; the tables keep this order
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the serial run as the workers run it: one thread (and fast on a busy machine)
    try:
        assert run_zoo(_args(tmp_path / "j1", 1, members)) == 0
    finally:
        torch.set_num_threads(threads)
    assert run_zoo(_args(tmp_path / "j2", 2, members)) == 0
    one = json.loads((tmp_path / "j1" / "zoo.json").read_text())["results"]
    two = json.loads((tmp_path / "j2" / "zoo.json").read_text())["results"]
    assert list(two) == list(one) == ["grid16", "default"]
    for name in one:  # every per-example hit of every row
        assert two[name]["hits"] == one[name]["hits"]
    assert two == one
    assert not multiprocessing.active_children()


@pytest.mark.timeout(300)
def test_an_item_that_fails_in_its_worker_stops_the_run_and_names_it(tmp_path, capsys):
    args = _args(tmp_path, 2, "default,text", text_tasks="nosuch", text_n=1, text_lengths="1024")
    assert run_zoo(args) == 1
    err = capsys.readouterr().err
    assert "text nosuch 1K failed" in err and "unknown task 'nosuch'" in err
    assert not multiprocessing.active_children()  # every worker ended, none left running


@pytest.mark.parametrize("command", [["eval", "zoo"], ["calibrate", "--prompts", "p.jsonl"]])
def test_cli_refuses_zero_jobs_before_any_work(command, capsys):
    from vlkv.deploy.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main([*command, "--jobs", "0"])
    assert exc.value.code == 2
    assert "--jobs" in capsys.readouterr().err
