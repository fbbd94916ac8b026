"""``vlkv eval zoo --verify`` (``lab/vlkv_lab/eval/zoo_verify.py``) on a tiny random LLaVA posing as a zoo member:
verifier rows at every budget, ``select`` at exactly its candidates' realized budgets and never raised,
``floor`` raised along the doubling chain only, the candidates' curves the zoo's own rows where they are the
same policy, and the tables and plot written beside the zoo's; without ``--verify`` nothing of it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from vlkv.common.compression.verify import VerifyConfig
from vlkv.deploy.synthetic_task import Example
from vlkv_lab.eval import zoo, zoo_verify
from vlkv_lab.eval.zoo import ZOO_BUDGETS, _configs, run_member, run_zoo
from vlkv_lab.zoo.interface import Member

N = 2
COLOURS = ("red", "blue", "green")


def _examples(n: int, seed: int = 0, split: str = "heldout") -> list[Example]:
    rng = np.random.default_rng(seed + (0 if split == "heldout" else 1000))
    out = []
    for i in range(n):
        image = Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))
        colour = COLOURS[i % 3]
        out.append(
            Example([image], "what colour is the square ?", f"the square {colour} .", colour, "colour", "c")
        )
    return out


@pytest.fixture(scope="module")
def tiny_member(tiny_model_dirs):
    mod = Member(
        "tiny", Path(tiny_model_dirs("llava-gqa")), 4, "tiny random LLaVA", _examples, frozenset(COLOURS)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only spins on a busy machine
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zoo, "member", lambda name: mod)
        # a short draft and a low cap: the random model's drafts rarely agree, so floor raises to the cap
        mp.setattr(zoo_verify, "CONFIG", VerifyConfig(draft_tokens=4, max_budget=0.05))
        yield mod
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def result(tiny_member):
    return run_member("tiny", N, 0, "heldout", _configs(False), ZOO_BUDGETS, chunk=1, verify=True)


def test_verifier_rows_at_every_budget_for_every_example(result):
    v = result["verify"]
    assert v["candidates"] == ["default", "uniform", "snapkv", "paper"]
    for mode in zoo_verify.MODES:
        assert sorted(v["modes"][mode], key=float) == [str(b) for b in ZOO_BUDGETS]
        for cell in v["modes"][mode].values():
            assert all(len(cell[f]) == N for f in zoo_verify.FIELDS)
            p = zoo_verify.point(cell)
            assert 0.0 <= p["accuracy"] <= 1.0 and 0.0 <= p["raised"] <= 1.0
    # the kept caches are the kept candidates' own caches as the zoo compresses them
    assert all(all(c["same"]) for mode in zoo_verify.MODES for c in v["modes"][mode].values())


def test_select_is_never_raised_and_realizes_its_candidates_budget(result):
    v = result["verify"]
    for b in ZOO_BUDGETS:
        cell = v["modes"]["select"][str(b)]
        assert cell["raises"] == [0] * N and zoo_verify.point(cell)["raised"] == 0.0
        assert all(math.isclose(x, b, rel_tol=1e-6) for x in cell["budget"])
        for i, (label, ratio) in enumerate(zip(cell["candidate"], cell["ratio"], strict=True)):
            assert ratio == pytest.approx(v["curves"][label]["ratio"][str(b)][i])  # example by example
        means = [zoo_verify._mean(v["curves"][c]["ratio"][str(b)]) for c in v["candidates"]]
        assert min(means) - 1e-9 <= zoo_verify.point(cell)["realized"] <= max(means) + 1e-9
        # an answer scored as the kept candidate's fixed row scores that example
        assert zoo_verify.as_fixed(v, "select", b) == 1.0


def test_floor_raises_only_by_doubling_to_the_cap_and_only_below_the_floor(result):
    v = result["verify"]
    cap, floor = v["config"]["max_budget"], v["config"]["floor"]
    for b in ZOO_BUDGETS:
        cell = v["modes"]["floor"][str(b)]
        for raises, kept, agree, met in zip(
            cell["raises"], cell["budget"], cell["agreement"], cell["floor_met"], strict=True
        ):
            top = max(cap, b)  # the cap is never below the requested budget
            assert kept == pytest.approx(min(b * 2**raises, top), rel=1e-6)
            assert met == (agree >= floor)
            assert met or kept == pytest.approx(top, rel=1e-6)  # short of the floor only at the cap
        assert (
            zoo_verify.point(cell)["realized"]
            >= zoo_verify.point(v["modes"]["select"][str(b)])["realized"] - 0.01
        )


def test_candidate_curves_are_the_zoos_rows_where_they_are_the_same_policy(result):
    v = result["verify"]
    rows = {label: v["curves"][label]["row"] for label in v["candidates"]}
    assert rows == {
        "default": "vlcache",
        "uniform": "",
        "snapkv": "snapkv",
        "paper": "vlcache before the zoo",
    }
    for label, row in rows.items():
        curve = v["curves"][label]
        assert sorted(curve["hits"], key=float) == sorted(
            [str(b) for b in (*ZOO_BUDGETS, *zoo_verify.FRONTIER)], key=float
        )
        if row:
            assert all(curve["hits"][str(b)] == result["hits"][row][str(b)] for b in ZOO_BUDGETS)
    assert zoo_verify.oracle_at(v, 0.04) is not None


def test_frontier_reads_a_curve_in_log_budget_and_holds_within_a_point():
    pts = [(0.01, 0.2, 0.01), (0.04, 0.6, 0.04), (0.16, 1.0, 0.16)]
    assert zoo_verify.at(pts, 0.02)[0] == pytest.approx(0.4)  # halfway in log budget
    assert zoo_verify.at(pts, 0.005) == (0.2, False)
    assert zoo_verify.at(pts, 0.3) == (1.0, True)
    ratio = {"0.01": [0.01], "0.04": [0.04]}
    v = {
        "candidates": ["a"],
        "curves": {"a": {"row": "", "hits": {"0.01": [False], "0.04": [True]}, "ratio": ratio}},
        "modes": {
            "floor": {
                "0.01": {"hits": [True], "ratio": [0.02], "raises": [1], "floor_met": [True], "same": [True]}
            }
        },
    }
    f = zoo_verify.frontier(v, "floor", 0.01)
    assert f["fixed"]["a"] == pytest.approx(0.5) and f["holds"] and f["margin"] == pytest.approx(0.5)
    v["modes"]["floor"]["0.01"]["hits"] = [False]
    assert not zoo_verify.frontier(v, "floor", 0.01)["holds"]


def _args(out, verify: bool) -> SimpleNamespace:
    return SimpleNamespace(
        n=1, seed=0, split="heldout", members="tiny", out=str(out), ablation=False, jobs=1, verify=verify
    )


def test_run_zoo_writes_the_verifier_section_and_plot_only_when_asked(tiny_member, tmp_path, monkeypatch):
    monkeypatch.setattr(zoo, "ZOO_BUDGETS", (0.02, 0.1))  # the hooks, not the rows again
    assert run_zoo(_args(tmp_path / "v", True)) == 0
    md = (tmp_path / "v" / "zoo.md").read_text()
    assert "## Verified compression" in md and "--verify" in md
    for b in (0.02, 0.1):
        for mode in zoo_verify.MODES:
            assert f"| {b:.0%} | **verify: {mode}** |" in md
    assert (tmp_path / "v" / "zoo_verify.png").stat().st_size > 0
    assert "verify" in json.loads((tmp_path / "v" / "zoo.json").read_text())["results"]["tiny"]
    assert run_zoo(_args(tmp_path / "plain", False)) == 0
    plain = json.loads((tmp_path / "plain" / "zoo.json").read_text())["results"]["tiny"]
    assert "verify" not in plain and not (tmp_path / "plain" / "zoo_verify.png").exists()
    assert "Verified compression" not in (tmp_path / "plain" / "zoo.md").read_text()


def test_verify_is_a_flag_of_the_zoo_only(capsys):
    from vlkv.deploy.cli.main import main

    with pytest.raises(SystemExit) as refused:  # the default model's report has no verified rows
        main(["eval", "--verify"])
    assert refused.value.code == 2 and "--verify" in capsys.readouterr().err
