"""A text-only prompt's observation window as its own final question (``common/model/question.py``,
the lab policy's ``question_min``/``question_max``, the preset ``vlcache_text_question``): the line-break rule, the chat
template's tail and head, the clipping, the fallback to ``text_window``, the option's serialized form, image
prompts unchanged, and the served prefill and the in-process evaluation handing the policy the same value."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import vlkv_lab.eval.presets  # noqa: F401  (the lab's presets: the experiments this names)
from policy_stats import column_stats
from vlkv.common.compression import PRESETS, policy_from_dict, preset
from vlkv.common.compression.registry import CompressionSettings, get_policy
from vlkv.common.model.inputs import prepare_inputs
from vlkv.common.model.question import TurnLayout, prompt_question, question_tokens
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import PreparedRequest
from vlkv.common.sampling import SamplingConfig

# A ChatML-like layout on made-up ids: 1 = <|im_start|>, 2 = <|im_end|> (special), 9 = "\n", 7 = "user",
# 8 = "assistant"; the template's tail after the message is <|im_end|> \n <|im_start|> assistant \n.
NL, START, END, USER, ASSISTANT = 9, 1, 2, 7, 8
LAYOUT = TurnLayout(
    breaks=frozenset({NL}), stops=frozenset({START, END}), tail=(END, NL, START, ASSISTANT, NL), head=2
)
HEAD = [START, USER, NL]
TAIL = list(LAYOUT.tail)


def test_the_question_is_what_follows_the_last_line_break_through_the_chat_tail():
    context, question = [20, 21, NL, 22, 23, 24], [30, 31, 32]
    ids = HEAD + context + [NL, NL] + question + TAIL
    assert question_tokens(ids, LAYOUT) == len(question) + len(TAIL)
    # the last break wins, a single one or a paragraph break alike
    assert question_tokens(HEAD + [20, NL] + question + TAIL, LAYOUT) == len(question) + len(TAIL)


def test_a_turn_with_no_line_break_has_no_question():
    assert question_tokens(HEAD + [20, 21, 22] + TAIL, LAYOUT) == 0  # the head's own "\n" does not count
    # nor does a break in an earlier turn (the search stops at the turn's special token)
    earlier = [START, USER, NL, 40, NL, 41, END, NL]
    assert question_tokens(earlier + HEAD + [20, 21] + TAIL, LAYOUT) == 0
    assert question_tokens([20, 21, 22], LAYOUT) == 0
    assert question_tokens(HEAD + [20, NL] + TAIL, LAYOUT) == len(TAIL)  # a break right before the tail
    assert question_tokens(HEAD + [20, NL, 30] + TAIL, None) == 0
    assert question_tokens(HEAD + [20, NL, 30] + TAIL, TurnLayout()) == 0


def test_a_prompt_without_the_template_tail_is_read_to_its_end():
    assert question_tokens(HEAD + [20, NL, 30, 31], LAYOUT) == 2
    # the tail is matched from the prompt's end as far as it agrees (here its last three ids)
    assert question_tokens(HEAD + [20, NL, 30, START, ASSISTANT, NL], LAYOUT) == 4


def test_prompt_question_is_zero_for_image_prompts_and_reads_tensors():
    ids = torch.tensor([HEAD + [20, NL, 30] + TAIL])
    assert prompt_question(ids, True, LAYOUT) == 1 + len(TAIL)
    assert prompt_question(ids, False, LAYOUT) == 0


def test_layout_from_a_chat_tokenizer(tiny_model_dirs):
    from vlkv.common.model.loading import load_processor

    tok = load_processor(tiny_model_dirs("llava-gqa")).tokenizer
    layout = TurnLayout.from_tokenizer(tok)
    assert set(tok.all_special_ids) <= layout.stops
    assert not layout.breaks  # the tiny word-level tokenizer splits on whitespace: no line-break token
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "what colour"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(rendered, add_special_tokens=False).input_ids
    assert layout.tail and tuple(ids[-len(layout.tail) :]) == layout.tail


def test_observed_window_is_the_question_clipped_and_falls_back_to_text_window():
    m = 200
    policy = get_policy("vlcache_lab", text_preset="", text_window=24, question_min=8, question_max=48)
    assert policy.observed_tau(m, m, 21) == 21
    assert policy.observed_tau(m, m, 3) == 8 and policy.observed_tau(m, m, 90) == 48  # clipped
    assert policy.observed_tau(m, m, 0) == 24  # no line break: the fixed window
    assert policy.observed_tau(12, 12, 30) == 12  # never more rows than the prompt
    assert policy.observed_tau(m, 20, 30) == 20  # an image prompt: its post-vision text
    assert policy.query_start(m, m, 21) == m - 21 and policy.query_start(m, m) == m - 24
    off = get_policy("vlcache_lab", text_preset="", text_window=24)
    assert off.observed_tau(m, m, 21) == 24  # question_max 0: the option is off


def test_question_option_serializes_and_is_checked():
    policy = get_policy("vlcache", text_preset="vlcache_text_question")
    assert policy_from_dict(policy.to_dict()) == policy
    text = preset("vlcache_text_question")
    assert (text.question_min, text.question_max) == (8, 48)
    span = policy_from_dict(PRESETS["vlcache_text_span"] | {"policy": "vlcache_lab"})  # the options off
    assert text.to_dict() == span.to_dict() | {"question_min": 8, "question_max": 48}
    assert policy_from_dict(text.to_dict()) == text
    for bad, message in (
        ({"question_max": -1}, "question_max"),
        ({"question_min": 9, "question_max": 8}, "question_min"),
        ({"question_max": 2.5}, "int"),
    ):
        with pytest.raises(ValueError, match=message):
            policy_from_dict({"policy": "vlcache_lab", **bad})


def test_question_preset_on_text_prompts_and_image_prompts_bitwise_unchanged():
    m, layers, q = 120, 3, 30
    policy = get_policy("vlcache", text_preset="vlcache_text_question")
    span = get_policy("vlcache", text_preset="vlcache_text_span")
    assert policy.query_start(m, m, q) == m - q and policy.query_start(m, m) == span.query_start(m, m)
    gen = torch.Generator().manual_seed(5)
    keys = [torch.randn(2, m, 4, generator=gen) for _ in range(layers)]
    for tau in (20, 0, 1):  # image prompts, whatever question a caller hands over
        stats = [
            column_stats(torch.rand(4, m, generator=gen), m - span.query_start(m, tau)) for _ in range(layers)
        ]
        ours = policy.compress(stats, keys, keys, alpha=0.2, m=m, tau=tau, question=q)
        theirs = span.compress(stats, keys, keys, alpha=0.2, m=m, tau=tau)
        pairs = zip(
            ours.kept_indices + ours.prompt_scores, theirs.kept_indices + theirs.prompt_scores, strict=True
        )
        assert all(torch.equal(a, b) for a, b in pairs)
    stats = [column_stats(torch.rand(4, m, generator=gen), q) for _ in range(layers)]
    policy.compress(stats, keys, keys, alpha=0.2, m=m, tau=m, question=q)  # the question's rows score it
    with pytest.raises(ValueError, match="query rows"):  # not the fixed window's
        span.compress(stats, keys, keys, alpha=0.2, m=m, tau=m)


def test_served_prefill_and_evaluation_pass_the_same_question(tiny_model_dirs, monkeypatch):
    from vlkv.common.config import ModelConfig
    from vlkv.common.model.loading import load_model, load_processor
    from vlkv.prefill_worker.engine import PrefillEngine
    from vlkv_lab.eval import evaluation

    path = tiny_model_dirs("llava-gqa")
    model, processor = load_model(ModelConfig(path=path)), load_processor(path)
    tok = processor.tokenizer
    real = TurnLayout.from_tokenizer(tok)
    # the tiny tokenizer has no line-break token: "it" plays the break here
    layout = dataclasses.replace(real, breaks=frozenset({tok.convert_tokens_to_ids("it")}))
    monkeypatch.setattr(TurnLayout, "from_tokenizer", classmethod(lambda cls, t: layout))
    words = "what colour shape is the square circle triangle red blue green".split()
    text = " ".join(words[i % len(words)] for i in range(60)) + " it what colour shape is the red circle"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    example = SimpleNamespace(images=[])
    task = SimpleNamespace(prompt_text=lambda proc, ex: prompt)
    (prep,) = evaluation.prepare(model, processor, [example], progress=False, task=task, next_attention=False)
    assert prep.tau == prep.m and prep.question == 7 + len(layout.tail) >= 8

    seen = []
    original = type(get_policy("vlcache")).compress

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("question"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(get_policy("vlcache")), "compress", spy)
    spec = ModelSpec.from_model(model, tok)
    assert spec.turns == layout
    engine = PrefillEngine(model, spec)
    engine_rows = []
    from vlkv.prefill_worker import engine as engine_module

    collector = engine_module.StatsCollector

    def spy_collector(q0, threshold):
        engine_rows.append(q0)
        return collector(q0, threshold)

    monkeypatch.setattr(engine_module, "StatsCollector", spy_collector)
    inputs = prepare_inputs(processor, [], prompt, spec.image_token_id)
    settings = CompressionSettings("vlcache", 0.3)
    question_policy = get_policy("vlcache", text_preset="vlcache_text_question")  # a request cannot name it
    monkeypatch.setattr(CompressionSettings, "build_policy", lambda self: question_policy)
    req = PreparedRequest("q", inputs.input_ids, {}, inputs.modality, SamplingConfig(), settings)
    served = engine.run(req).cache
    evaluated = evaluation.compress(prep, "vlcache", 0.3, text_preset="vlcache_text_question")
    from vlkv.deploy.calibrate.measure import (
        _candidate_caches,  # vlkv calibrate compresses its candidates alike
    )

    (calibrated,), _ = _candidate_caches(prep, [("question", question_policy, 0.3)], [0.3])
    assert seen == [prep.question] * 3
    for a, b, c in zip(served.kept_indices, evaluated.kept_indices, calibrated.kept_indices, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    # the question's rows (compress checks the statistics cover them), not the 24-row fallback
    assert engine_rows == [prep.m - prep.question]


def test_smollm2_chat_prompt_question_is_its_last_paragraph_and_the_template_tail():
    from vlkv.common.model.loading import load_processor
    from vlkv_lab.zoo import smollm2
    from vlkv_lab.zoo import text_suite as ts

    processor = load_processor(str(smollm2.text_checkpoint()))
    tok = processor.tokenizer
    layout = TurnLayout.from_tokenizer(tok)
    assert tok.decode(list(layout.tail)) == "<|im_end|>\n<|im_start|>assistant\n" and layout.head == 2
    item = ts.items("niah_single_1", 1024, "train", n=1, tokenizer=tok)[0]
    ids = prepare_inputs(processor, [], ts.render(item, processor), -1).input_ids
    n = prompt_question(ids, True, layout)
    assert tok.decode(ids[0, -n:]) == item.question + "<|im_end|>\n<|im_start|>assistant\n"
    # a message with no line break at all: no question, the preset keeps its fixed window
    one_line = [{"role": "user", "content": f"{item.context} {item.question}"}]
    text = tok.apply_chat_template(one_line, add_generation_prompt=True, tokenize=False)
    assert prompt_question(prepare_inputs(processor, [], text, -1).input_ids, True, layout) == 0
