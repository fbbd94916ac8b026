"""Zoo member grid16: determinism, disjoint splits, scoring, geometry, and the shipped checkpoint's shape."""

import pytest
from vlkv.tools.task.synthetic_task import COLOURS
from vlkv.tools.zoo import grid16, member


def _fingerprint(ex):
    return (tuple(im.tobytes() for im in ex.images), ex.question, ex.answer, ex.kind)


def test_generator_is_deterministic_and_seeded():
    a, b = grid16.make_examples(30, seed=3), grid16.make_examples(30, seed=3)
    assert [_fingerprint(x) for x in a] == [_fingerprint(x) for x in b]
    assert grid16.make_example(7, seed=3).answer == a[7].answer
    assert [_fingerprint(x) for x in a] != [_fingerprint(x) for x in grid16.make_examples(30, seed=4)]


def test_splits_are_disjoint():
    train = {_fingerprint(x) for x in grid16.make_examples(60, split="train")}
    heldout = {_fingerprint(x) for x in grid16.make_examples(60, split="heldout")}
    assert not train & heldout
    with pytest.raises(ValueError):
        grid16.make_example(0, split="test")


def test_examples_are_content_keyed_and_well_posed():
    examples = grid16.make_examples(120)
    assert {ex.kind for ex in examples} == set(grid16.KINDS)
    for ex in examples:
        (objs,) = ex.objects
        assert len({o.colour for o in objs}) == len(objs)  # colours are the keys: unique per scene
        for _, o in ex.focus:
            assert o.colour in ex.question and f"the {o.colour} {o.shape}" in ex.answer
        words = ex.answer.split()
        assert words[0] == "the" and words[2] == ex.focus[0][1].shape  # the deciding word is never first
        assert len(words) + 1 <= grid16.MAX_NEW_TOKENS
        assert ex.images[0].size == (grid16.GEOM.image, grid16.GEOM.image)
    assert grid16.GEOM.grid**2 == 256


def test_scoring_reads_colours_and_shapes_in_order():
    ex = next(x for x in grid16.make_examples(50) if x.kind == "shapes_of_two_colours")
    (_, a), (_, b) = ex.focus
    assert grid16.is_correct(ex.answer, ex)
    assert grid16.is_correct(ex.answer + " </s> the green cross", ex)  # text after eos is ignored
    assert not grid16.is_correct(f"the {b.colour} {b.shape} and the {a.colour} {a.shape} .", ex)
    wrong = next(s for s in ("square", "circle", "triangle", "cross") if s != b.shape)
    assert not grid16.is_correct(f"the {a.colour} {a.shape} and the {b.colour} {wrong} .", ex)
    assert not grid16.is_correct(f"the {a.colour} {a.shape} .", ex)
    other = next(c for c in COLOURS if c not in (a.colour, b.colour))
    assert not grid16.is_correct(f"the {a.colour} {a.shape} and the {other} {b.shape} .", ex)


def test_member_interface_and_shipped_checkpoint():
    m = member("grid16")
    assert m.NAME == "grid16" and m.GEOMETRY and callable(m.prompt_text)
    if not (m.MODEL_DIR / "config.json").exists():
        pytest.skip("checkpoint not trained yet")
    from transformers import AutoConfig
    from vlkv.common.model.loading import load_processor

    cfg = AutoConfig.from_pretrained(m.MODEL_DIR)
    assert cfg.model_type == "llava" and cfg.image_seq_length == 256
    processor = load_processor(str(m.MODEL_DIR))
    ex = m.make_examples(1)[0]
    ids = processor(images=ex.images, text=m.prompt_text(processor, ex))["input_ids"][0]
    assert list(ids).count(cfg.image_token_index) == 256
    assert len(ids) - 256 < 20  # a short question after the image
    assert sum(f.stat().st_size for f in m.MODEL_DIR.iterdir()) <= 10 << 20
