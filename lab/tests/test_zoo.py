"""The model zoo (lab/vlkv_lab/zoo): every member a row. Its task is deterministic, splits are disjoint and questions
well posed; the one ``is_correct`` reads its scored words in order; its shipped checkpoint loads like a user's,
has the member's geometry and answers held-out questions with the full cache; ``vlkv eval zoo`` runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from vlkv.deploy.synthetic_task import COLOURS, NUMBERS, SHAPES, Example
from vlkv_lab import zoo
from vlkv_lab.eval.evaluation import evaluate, prepare
from vlkv_lab.eval.zoo import evaluate_many, run_zoo, worst_member
from vlkv_lab.zoo import MEMBERS, grid16, longprompt, member
from vlkv_lab.zoo.accuracy import load_member

# --- each member's own task: what its held-out examples must look like ------------------------------------


def _default(examples: list[Example]) -> None:
    for ex in examples:
        assert ex.answer.split()[0] in ("the", "there")  # the deciding word is never the first token
        assert ex.target in ex.answer.split()


def _grid16(examples: list[Example]) -> None:
    assert {ex.kind for ex in examples} == set(grid16.KINDS)
    for ex in examples:
        (objs,) = ex.objects
        assert len({o.colour for o in objs}) == len(objs)  # colours are the keys: unique per scene
        for _, o in ex.focus:
            assert o.colour in ex.question and f"the {o.colour} {o.shape}" in ex.answer
        words = ex.answer.split()
        assert words[0] == "the" and words[2] == ex.focus[0][1].shape  # the deciding word is never first


def _longprompt(examples: list[Example]) -> None:
    places = []
    for ex in examples:
        (objs,) = ex.objects
        assert len({o.colour for o in objs}) == len(objs)
        ((_, obj),) = ex.focus
        words = ex.question.split()
        assert len(words) >= longprompt.MIN_QUESTION_TOKENS and ex.question.endswith(longprompt.CLOSING)
        assert [w for w in words if w in COLOURS or w in SHAPES] == [obj.colour]  # one key, no distractor
        places.append(words.index(obj.colour) / len(words))
        assert ex.answer.split()[1:3] == [obj.colour, obj.shape]  # neither deciding word is the first token
    assert min(places) < 0.2 and max(places) > 0.8 and sum(0.2 < p < 0.8 for p in places) > 20
    assert not [w for w in longprompt.SYSTEM_PROMPT.split() if w in COLOURS or w in SHAPES]


def _next_anyres(examples: list[Example]) -> None:
    for ex in examples:
        assert ex.images[0].size in ((672, 336), (336, 672))
        shape = ex.question.split()[4]
        assert [o.shape for o in ex.objects[0]].count(shape) == 1
        ((_, obj),) = ex.focus
        assert ex.answer == f"the {shape} {obj.colour} ." and ex.target == obj.colour


def _deep8(examples: list[Example]) -> None:
    for ex in examples:
        (_, a), (_, b) = ex.focus
        assert abs(a.cell[0] - b.cell[0]) >= 15 and abs(a.cell[1] - b.cell[1]) >= 15  # opposite corners
        assert ex.question == f"what colour are the {a.shape} and the {b.shape} ?"
        assert ex.answer == f"the {a.shape} {a.colour} and the {b.shape} {b.colour} ."
        for attr in ("shape", "colour"):
            values = [getattr(o, attr) for o in ex.objects[0]]
            assert len(set(values)) == len(values) == 4


def _deep8_sparsity(model, processor, examples) -> None:
    from vlkv_lab.zoo.sparsity import layer_sparsities

    gamma = layer_sparsities(model, processor, examples)
    assert min(gamma[:2]) < 0.3 and sum(gamma[:2]) / 2 + 0.2 < sum(gamma[-2:]) / 2  # dense early, sparse late


def _smol_objects(examples: list[Example]) -> None:
    assert {len(ex.images) for ex in examples} == {3, 4}  # 600+-token prompts
    for ex in examples:
        ((_, obj),) = ex.focus
        assert ex.answer == (obj.colour if ex.kind == "colour_of_shape" else obj.shape)
        assert (obj.shape if ex.kind == "colour_of_shape" else obj.colour) in ex.question


def _smol_codes(examples: list[Example]) -> None:
    for ex in examples:
        ((_, obj),) = ex.focus
        assert len(ex.images) == 1 and ex.answer == f"The {obj.colour} {obj.shape} has code {ex.target}"
        assert f"The {obj.colour} {obj.shape} has code {ex.target}." in ex.question  # the text holds the code


@dataclass(frozen=True)
class Row:
    """What one member's task and checkpoint must show."""

    task: Callable[[list[Example]], None]
    image_sizes: tuple[tuple[int, int], ...]
    vision_tokens: tuple[int, ...]  # per image (LLaVA-NeXT's any-res: one count per image shape)
    layers: int
    text_before: int = 0  # prompt tokens before the first image, at least
    text_after: tuple[int, int] = (1, 20)  # prompt tokens after the last image: at least, below
    model_class: str = "LlavaForConditionalGeneration"
    max_bytes: int = 10 << 20
    model_check: Callable | None = None
    api: bool = False  # asked through the public gRPC API too
    pool_mb: int = 16  # the served KV pool in the public-API test
    n: int = 30  # held-out examples the task check reads


ROWS = {
    "default": Row(_default, ((336, 336),), (576,), 4, text_before=20, max_bytes=20 << 20),
    "grid16": Row(_grid16, ((224, 224),), (256,), 4, n=60),
    "longprompt": Row(_longprompt, ((168, 168),), (144,), 4, text_before=100, text_after=(100, 170), n=60),
    "next_anyres": Row(
        _next_anyres,
        ((672, 336), (336, 672)),
        (1752, 1776),
        4,
        model_class="LlavaNextForConditionalGeneration",
        api=True,
    ),
    "deep8": Row(_deep8, ((336, 336),), (576,), 8, model_check=_deep8_sparsity),
    "smol_objects": Row(_smol_objects, ((196, 196),), (196,), 30, 20, (10, 30), api=True, pool_mb=64),
    "smol_codes": Row(_smol_codes, ((196, 196),), (196,), 30, 20, (500, 600), api=True, pool_mb=64),
}


def test_registry_names_every_member_with_a_row_and_refuses_unknown_ones():
    assert MEMBERS[0] == "default" and len(set(MEMBERS)) == len(MEMBERS) >= 5
    assert set(ROWS) == set(MEMBERS)
    assert [member(n).name for n in MEMBERS] == list(MEMBERS)
    with pytest.raises(ValueError, match="members: default"):
        member("nope")


def _fingerprint(ex: Example):
    return (tuple(im.tobytes() for im in ex.images), ex.question, ex.answer, ex.kind)


@pytest.mark.parametrize("name", MEMBERS)
def test_examples_are_deterministic_seeded_split_and_well_posed(name):
    m, row = member(name), ROWS[name]
    a, b = m.make_examples(8, seed=3, split="heldout"), m.make_examples(8, seed=3, split="heldout")
    assert [_fingerprint(x) for x in a] == [_fingerprint(x) for x in b]
    assert {_fingerprint(x) for x in a}.isdisjoint(_fingerprint(x) for x in m.make_examples(8, 4, "heldout"))
    assert {_fingerprint(x) for x in a}.isdisjoint(_fingerprint(x) for x in m.make_examples(8, 3, "train"))
    with pytest.raises(ValueError):
        m.make_examples(1, seed=0, split="test")
    examples = m.make_examples(row.n, seed=0, split="heldout")
    for ex in examples:
        assert {im.size for im in ex.images} <= set(row.image_sizes)
        assert len(ex.answer.split()) + 1 <= m.max_new_tokens
        assert all(o in ex.objects[i] for i, o in ex.focus)
    row.task(examples)


def _other(word: str) -> str:
    if word.isdigit():  # a code
        return str(int(word) + 1)
    pool = next(p for p in (list(COLOURS), SHAPES, list(NUMBERS.values())) if word in p)
    return next(w for w in pool if w != word)


@pytest.mark.parametrize("name", MEMBERS)
def test_the_one_is_correct_reads_the_scored_words_in_order(name):
    m = member(name)
    for ex in m.make_examples(20, seed=0, split="heldout"):
        words = ex.answer.split()
        scored = [i for i, w in enumerate(words) if w in m.scored]
        assert scored and ex.target in m.scored
        assert m.is_correct(ex.answer, ex) and m.is_correct(ex.answer + " </s> the red cross", ex)
        last = scored[-1]
        assert not m.is_correct(" ".join([*words[:last], _other(words[last]), *words[last + 1 :]]), ex)
        assert not m.is_correct(" ".join(words[:last]) + " .", ex)  # the last region missing
        in_order = [words[i] for i in scored]
        if in_order != in_order[::-1]:
            assert not m.is_correct(" ".join(in_order[::-1]), ex)


def test_longprompt_training_grows_the_message_to_the_evaluated_length():
    assert len(longprompt.train_example(5, 0.0).question.split()) < longprompt.MIN_QUESTION_TOKENS
    assert len(longprompt.train_example(5, 0.5).question.split()) >= longprompt.MIN_QUESTION_TOKENS
    assert longprompt.train_example(5, 0.5).question != longprompt.make_example(5, split="heldout").question


@pytest.fixture(scope="module")
def shipped():
    """Each member's checkpoint loaded once for the module (``load_model`` / ``load_processor``)."""
    cache: dict = {}

    def get(name):
        if name not in cache:
            cache.clear()  # one model at a time
            cache[name] = load_member(member(name))
        return cache[name]

    return get


@pytest.mark.parametrize("name", MEMBERS)
def test_checkpoint_loads_like_a_user_checkpoint_has_its_geometry_and_answers(name, shipped):
    m, row = member(name), ROWS[name]
    model, processor = shipped(name)
    assert type(model).__name__ == row.model_class
    assert model.config.text_config.num_hidden_layers == row.layers
    # a real-decoder member ships only its trained parts; the others ship their whole checkpoint
    shipped_dir = Path(zoo.__file__).parent / "models" / name if m.assemble else Path(m.model_dir)
    assert sum(f.stat().st_size for f in shipped_dir.iterdir() if f.is_file()) <= row.max_bytes
    examples = m.make_examples(4, seed=0, split="heldout")
    ex = min(examples, key=lambda x: len(x.images))
    ids = list(processor(images=ex.images, text=m.prompt_text(processor, ex))["input_ids"][0])
    image_id = model.config.image_token_id
    first, n_img = ids.index(image_id), ids.count(image_id)
    per_image, rest = divmod(n_img, len(ex.images))
    assert rest == 0 and per_image in row.vision_tokens and processor.tokenizer.unk_token_id not in ids
    assert first >= row.text_before and row.text_after[0] <= len(ids) - first - n_img < row.text_after[1]
    prepared = prepare(model, processor, examples, False, task=m)
    full = evaluate(model, processor, prepared, "full", 1.0, m.max_new_tokens)
    assert full.accuracy >= 0.75, full.answers
    # all runs decoded as one batch give each run's own answers
    configs = [("vlcache", "vlcache", {}), ("snapkv", "snapkv", {})]
    answers: dict = {}
    together = evaluate_many(model, processor, prepared, configs, 0.1, m.max_new_tokens, answers)
    alone = evaluate(model, processor, prepared, "vlcache", 0.1, m.max_new_tokens)
    assert answers[0.1] == alone.answers and together["vlcache"] == alone.accuracy
    if row.model_check:
        row.model_check(model, processor, examples)


@pytest.mark.parametrize("name", [n for n in MEMBERS if ROWS[n].api])
def test_served_through_the_public_api(name):
    from inproc_cluster import InProcCluster
    from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
    from vlkv.deploy.client import build_request, generate, png_bytes

    m = member(name)
    pool = PoolConfig(pool_bytes=ROWS[name].pool_mb << 20)
    path = m.assemble() if m.assemble else m.model_dir  # a real-decoder member is assembled on first use
    cfg = ServerConfig(model=ModelConfig(path=str(path)), pool=pool)
    cluster = InProcCluster(cfg)
    try:
        ex = m.make_examples(2, seed=0, split="heldout")[1]
        for policy, budget in (("full", None), ("vlcache", 0.1)):
            req = build_request(
                images=[png_bytes(im) for im in ex.images],
                question=ex.question,
                max_new_tokens=m.max_new_tokens,
                policy=policy,
                budget=budget,
            )
            out = generate(cluster.stub, req, timeout=120)
            assert out.finished.usage.prompt_tokens > min(ROWS[name].vision_tokens)
            if policy == "full":
                assert m.is_correct(out.text, ex), out.text
    finally:
        cluster.close()


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
