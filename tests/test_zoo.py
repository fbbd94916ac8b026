"""The model zoo (tools/zoo): every member keeps the interface, loads like a user's checkpoint, answers its
held-out questions with the full cache, and ``vlkv eval --zoo`` runs on it end to end."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.tools.eval.evaluation import evaluate, prepare
from vlkv.tools.eval.zoo import evaluate_many, run_zoo, worst_member
from vlkv.tools.zoo import MEMBERS, member

SHIPPED = [n for n in MEMBERS if importlib.util.find_spec(f"vlkv.tools.zoo.{n}") is not None]


def test_registry_names_every_member_and_refuses_unknown_ones():
    assert MEMBERS[0] == "default" and len(set(MEMBERS)) == len(MEMBERS) >= 5
    with pytest.raises(ValueError, match="members: default"):
        member("nope")


@pytest.mark.parametrize("name", SHIPPED)
def test_member_interface_and_splits(name):
    mod = member(name)
    for attr in (
        "NAME",
        "MODEL_DIR",
        "MAX_NEW_TOKENS",
        "GEOMETRY",
        "make_examples",
        "is_correct",
        "prompt_text",
    ):
        assert hasattr(mod, attr), attr
    size = sum(f.stat().st_size for f in mod.MODEL_DIR.iterdir() if f.is_file())
    assert size <= 10 * 2**20 or name == "default"
    a, b = mod.make_examples(3, seed=0, split="train"), mod.make_examples(3, seed=0, split="heldout")
    again = mod.make_examples(3, seed=0, split="heldout")
    assert [e.question for e in b] == [e.question for e in again]
    assert [e.images[0].tobytes() for e in b] == [e.images[0].tobytes() for e in again]
    assert [e.images[0].tobytes() for e in a] != [e.images[0].tobytes() for e in b]
    for ex in b:
        assert mod.is_correct(ex.answer, ex)


@pytest.mark.parametrize("name", SHIPPED)
def test_member_loads_like_a_user_checkpoint_and_answers_with_the_full_cache(name):
    mod = member(name)
    model = load_model(ModelConfig(path=str(mod.MODEL_DIR)))
    processor = load_processor(str(mod.MODEL_DIR))
    prepared = prepare(model, processor, mod.make_examples(4, seed=0, split="heldout"), False, task=mod)
    full = evaluate(model, processor, prepared, "full", 1.0, mod.MAX_NEW_TOKENS)
    assert full.accuracy >= 0.75, full.answers
    # all runs decoded as one batch give each run's own answers
    configs = [("vlcache", "vlcache", {}), ("snapkv", "snapkv", {})]
    answers: dict = {}
    together = evaluate_many(model, processor, prepared, configs, 0.1, mod.MAX_NEW_TOKENS, answers)
    alone = evaluate(model, processor, prepared, "vlcache", 0.1, mod.MAX_NEW_TOKENS)
    assert answers[0.1] == alone.answers and together["vlcache"] == alone.accuracy


def test_worst_member_picks_the_lowest_relative_accuracy():
    results = {
        "a": {"full": 1.0, "rows": {"p": {"0.1": 0.9}}},
        "b": {"full": 0.5, "rows": {"p": {"0.1": 0.4}}},
    }
    assert worst_member(results, "p", [0.1]) == {"0.1": (pytest.approx(0.8), "b")}


def test_eval_zoo_command_writes_tables_json_and_plot(tmp_path):
    args = SimpleNamespace(n=2, seed=0, split="heldout", members="default", out=str(tmp_path), ablation=False)
    assert run_zoo(args) == 0
    data = json.loads((tmp_path / "zoo.json").read_text())
    rows = data["results"]["default"]["rows"]
    assert set(rows) >= {"vlcache", "snapkv", "pyramidkv", "random"} and set(rows["vlcache"]) == {
        "0.01",
        "0.02",
        "0.05",
        "0.1",
    }
    md = (tmp_path / "zoo.md").read_text()
    assert "## default" in md and "## Worst member" in md and (tmp_path / "zoo.png").stat().st_size > 0
