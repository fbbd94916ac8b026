"""Zoo member deep8: its two-region task, scoring, and the shipped 8-layer checkpoint (dense early layers,
sparse later ones)."""

from __future__ import annotations

import pytest
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.tools.zoo import deep8, member
from vlkv.tools.zoo.next_scenes import generate_answer, is_correct, layer_sparsities

M = deep8


def test_member_interface():
    mod = member("deep8")
    for name in (
        "NAME",
        "MODEL_DIR",
        "MAX_NEW_TOKENS",
        "GEOMETRY",
        "make_examples",
        "is_correct",
        "prompt_text",
    ):
        assert hasattr(mod, name), name


def test_examples_are_deterministic_and_splits_disjoint():
    a, b = M.make_examples(5, seed=2, split="train"), M.make_examples(5, seed=2, split="train")
    assert [(x.images[0].tobytes(), x.answer) for x in a] == [(x.images[0].tobytes(), x.answer) for x in b]
    held = M.make_examples(5, seed=2, split="heldout")
    assert {x.images[0].tobytes() for x in a}.isdisjoint({x.images[0].tobytes() for x in held})
    with pytest.raises(ValueError):
        M.make_examples(1, split="valid")


def test_the_two_asked_objects_lie_in_opposite_corners():
    for ex in M.make_examples(30):
        (_, a), (_, b) = ex.focus
        assert abs(a.cell[0] - b.cell[0]) >= 15 and abs(a.cell[1] - b.cell[1]) >= 15
        assert ex.question == f"what colour are the {a.shape} and the {b.shape} ?"
        assert ex.answer == f"the {a.shape} {a.colour} and the {b.shape} {b.colour} ."
        for attr in ("shape", "colour"):
            values = [getattr(o, attr) for o in ex.objects[0]]
            assert len(set(values)) == len(values) == 4


def test_scoring_needs_both_shapes():
    ex = M.make_examples(1)[0]
    (_, a), (_, b) = ex.focus
    other = next(c for c in ("red", "green", "blue", "yellow", "purple") if c != b.colour)
    assert is_correct(ex.answer, ex)
    assert not is_correct(f"the {a.shape} {a.colour} and the {b.shape} {other} .", ex)
    assert not is_correct(f"the {a.shape} {a.colour} .", ex)


def test_shipped_checkpoint_has_8_layers_dense_early_sparse_later_and_answers():
    model = load_model(ModelConfig(path=str(M.MODEL_DIR)))
    processor = load_processor(str(M.MODEL_DIR))
    assert model.config.text_config.num_hidden_layers == 8
    assert sum(f.stat().st_size for f in M.MODEL_DIR.iterdir()) < 10e6
    examples = M.make_examples(4, seed=0)
    assert all(is_correct(generate_answer(model, processor, ex, M.MAX_NEW_TOKENS), ex) for ex in examples[:2])
    gamma = layer_sparsities(model, processor, examples)
    assert min(gamma[:2]) < 0.3 and sum(gamma[:2]) / 2 + 0.2 < sum(gamma[-2:]) / 2  # dense early, sparse late
