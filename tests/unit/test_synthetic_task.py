"""Synthetic visual question task: determinism, splits, scoring, and the shipped default model."""

from pathlib import Path

import pytest
import torch
from vlkv.deploy.synthetic_task import (
    COLOURS,
    IMAGE_SIZE,
    KINDS,
    LONG_KIND,
    LONG_MAX_NEW_TOKENS,
    PATCH_SIZE,
    SPAN,
    TOKENS_PER_IMAGE,
    VOCAB,
    deciding_words,
    is_correct,
    make_example,
    make_examples,
    scene_questions,
)
from vlkv_lab.zoo.accuracy import full_cache_answers
from vlkv_lab.zoo.default import MEMBER

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "common" / "default_model"


def _fingerprint(ex):
    return (tuple(im.tobytes() for im in ex.images), ex.question, ex.answer, ex.kind)


def test_generator_is_deterministic():
    a = make_examples(40, seed=7)
    b = make_examples(40, seed=7)
    assert [_fingerprint(x) for x in a] == [_fingerprint(x) for x in b]
    assert make_example(13, seed=7).answer == a[13].answer
    c = make_examples(40, seed=8)
    assert [_fingerprint(x) for x in a] != [_fingerprint(x) for x in c]


def test_splits_are_disjoint():
    train = {_fingerprint(x) for x in make_examples(400, seed=0, split="train")}
    held = {_fingerprint(x) for x in make_examples(200, seed=0, split="heldout")}
    assert not train & held
    with pytest.raises(ValueError):
        make_examples(1, split="test")


def test_examples_are_well_formed():
    exs = make_examples(500, seed=3)
    # the long kind weighs 0 in the main mix: only asked for by name
    assert {x.kind for x in exs} == set(KINDS) - {LONG_KIND} and len(KINDS) >= 5
    exs += [make_example(i, seed=3, kind=LONG_KIND) for i in range(30)]
    assert (IMAGE_SIZE // PATCH_SIZE) ** 2 == TOKENS_PER_IMAGE == 576
    words = set(VOCAB) | {":"}  # ":" is a chat-frame token ("ASSISTANT :"); the long question uses it too
    for ex in exs:
        assert all(im.size == (IMAGE_SIZE, IMAGE_SIZE) and im.mode == "RGB" for im in ex.images)
        assert len(ex.images) == (2 if ex.kind.endswith("_2img") else 1)
        assert set(ex.question.split()) <= words and set(ex.answer.split()) <= words
        # no deciding word is among the first two answer tokens; the last one is the target
        answer = ex.answer.split()
        assert not set(answer[:2]) & set(deciding_words(ex.answer))
        assert deciding_words(ex.answer)[-1] == ex.target
        # question after the images; the question is well posed for the scene
        content = ex.messages[0]["content"]
        assert [p["type"] for p in content] == ["image"] * len(ex.images) + ["text"]
        qas = {(q.question, q.answer) for q in scene_questions(ex.objects)}
        assert (ex.question, ex.answer) in qas or ex.kind == LONG_KIND
        # the objects the answer reads are in the scene, and their colour shows in their patches
        for im, obj in ex.focus:
            assert obj in ex.objects[im]
            r, c = obj.cell
            box = ex.images[im].crop(
                (c * PATCH_SIZE, r * PATCH_SIZE, (c + SPAN) * PATCH_SIZE, (r + SPAN) * PATCH_SIZE)
            )
            near = {k: 0 for k in COLOURS}
            for count, rgb in box.getcolors(1 << 16):
                for k, ref in COLOURS.items():
                    near[k] += count * (sum((a - b) ** 2 for a, b in zip(rgb, ref, strict=True)) < 40**2)
            assert near[obj.colour] > 100 and all(v == 0 for k, v in near.items() if k != obj.colour)


def test_two_shapes_kind_reads_two_regions_and_half_share_a_colour():
    exs = [make_example(i, seed=5, kind="colour_of_two_shapes") for i in range(200)]
    same = 0
    for ex in exs:
        a, b = (o for _, o in ex.focus)
        assert a.cell != b.cell and a.shape != b.shape
        assert deciding_words(ex.answer) == [a.colour, b.colour] and ex.target == b.colour
        assert ex.answer.split()[6] == b.colour  # the second look-up is the 7th generated token
        same += a.colour == b.colour
    assert 70 <= same <= 130


def test_long_kind_decides_late_on_the_image():
    exs = [make_example(i, seed=6, kind=LONG_KIND) for i in range(50)]
    short = make_example(0, seed=6, kind="colour_of_shape")
    for ex in exs:
        (_, obj), words = ex.focus[0], ex.answer.split()
        assert len(words) + 1 >= 64 and len(words) + 1 <= LONG_MAX_NEW_TOKENS  # + eos
        assert deciding_words(ex.answer) == [obj.colour] == [ex.target]
        assert words.index(obj.colour) == len(words) - 2  # the 67th of 69 tokens
        assert words.count(obj.shape) >= 4 and ex.question.split()[-2] == obj.shape
        assert ex.question != short.question and len(ex.images) == 1
    # the same scene stream as the short colour kind: only the question and the answer differ
    same = make_example(3, seed=6, kind="colour_of_shape")
    assert same.images[0].tobytes() == exs[3].images[0].tobytes() and same.target == exs[3].target


def test_is_correct():
    exs = make_examples(200, seed=1)
    ex = next(x for x in exs if x.kind == "colour_of_shape")
    other = next(c for c in sorted(COLOURS) if c != ex.target)
    shape = ex.answer.split()[1]
    assert ex.answer.split()[2] == ex.target
    assert is_correct(ex.answer, ex)
    assert is_correct(f"{ex.answer} </s>", ex)
    assert is_correct(f"{ex.answer} </s> red blue", ex)
    assert is_correct(f"the {shape} {ex.target}", ex)
    assert not is_correct(f"the {shape} {other} .", ex)
    assert not is_correct(f"the {shape} {other} {ex.target} .", ex)
    assert not is_correct(f"the {shape}", ex)
    assert not is_correct("", ex)
    two = next(x for x in exs if x.kind == "colour_of_shape_2img")
    assert is_correct(two.answer, two)
    wrong = next(c for c in sorted(COLOURS) if c != two.target)
    assert not is_correct(two.answer.replace(two.target, wrong), two)
    cnt = next(x for x in exs if x.kind == "count")
    assert is_correct(cnt.answer, cnt)
    assert not is_correct("there are " + ("two" if cnt.target != "two" else "three") + " .", cnt)
    two_shapes = next(x for x in exs if x.kind == "colour_of_two_shapes")
    assert is_correct(two_shapes.answer, two_shapes)
    assert not is_correct(two_shapes.answer.rsplit(",", 1)[0], two_shapes)  # second colour missing
    assert not is_correct(f"{two_shapes.answer} same", two_shapes)  # a stray verdict word


_HAVE_MODEL = (DEFAULT_MODEL / "model.safetensors").exists()


@pytest.mark.skipif(not _HAVE_MODEL, reason="default model not trained yet")
def test_default_model_answers_heldout_examples():
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.set_num_threads(2)
    processor = AutoProcessor.from_pretrained(DEFAULT_MODEL)
    model = LlavaForConditionalGeneration.from_pretrained(DEFAULT_MODEL).eval()
    cfg = model.config
    assert cfg.text_config.num_key_value_heads < cfg.text_config.num_attention_heads  # GQA
    assert cfg.text_config.num_hidden_layers >= 2
    assert cfg.image_seq_length == 576 and cfg.projector_hidden_act == "gelu"
    assert cfg.image_token_id == processor.tokenizer.convert_tokens_to_ids("<image>")
    assert sum(f.stat().st_size for f in DEFAULT_MODEL.iterdir()) <= 20 * 2**20
    exs = make_examples(24, seed=0, split="heldout")
    answers = full_cache_answers(MEMBER, model, processor, exs)
    hits = sum(is_correct(a, ex) for a, ex in zip(answers, exs, strict=True))
    assert hits >= 22, list(zip(answers, [ex.answer for ex in exs], strict=True))
    assert any(len(ex.images) == 2 for ex in exs)
    # the long kind: the whole 69-token answer, its colour read 66 tokens after the prompt
    longs = [make_example(i, seed=0, split="heldout", kind=LONG_KIND) for i in range(4)]
    texts = full_cache_answers(MEMBER, model, processor, longs, LONG_MAX_NEW_TOKENS)
    assert sum(is_correct(t, ex) for t, ex in zip(texts, longs, strict=True)) >= 3, texts
    assert all(len(t.split()) >= 60 for t in texts), texts
