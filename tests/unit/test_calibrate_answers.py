"""``vlkv calibrate --rerank``'s answer recall (``deploy/calibrate/answers.py``): the question from the rendered
prompt, the retrieved words of the full cache's answer, the recall and its fallback; the ranking with the
rule on and off on scripted rows; the optional column in the profile and its table; one small run end to
end."""

from __future__ import annotations

import json

import pytest
from vlkv.common.compression.presets import PRESETS
from vlkv.common.compression.profile import CompressionProfile, ProfileEntry, profile_from_dict, read_profile
from vlkv.common.compression.registry import policy_from_dict
from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.common.model.loading import load_processor
from vlkv.deploy import synthetic_task
from vlkv.deploy.calibrate.answers import (
    answer_recall,
    generation_suffix,
    question_of,
    rarity_weights,
    retrieved_words,
    words,
)
from vlkv.deploy.calibrate.measure import CANDIDATES, best_per_budget, calibrate, format_table, rerank_set
from vlkv.deploy.calibrate.prompts import write_prompts

CHATML = "<|im_end|>\n<|im_start|>assistant\n"
NEEDLE = (
    "<|im_start|>user\nA thick fog waited beside the sleeping houses.\nThe secret number of Yara is 92736.\n\n"
    "What is the secret number of Yara? Answer with the number only." + CHATML
)


def test_the_question_is_the_last_line_of_the_last_turn():
    assert question_of(NEEDLE, CHATML) == "What is the secret number of Yara? Answer with the number only."
    assert question_of("a plain prompt\nIts question?\n\n", "") == "Its question?"
    assert question_of("one line, another suffix", CHATML) == "one line, another suffix"
    assert question_of("", CHATML) == ""


def test_the_generation_suffix_comes_from_the_chat_template():
    class Chat:
        chat_template = "<s>user: ...</u>"

        @staticmethod
        def apply_chat_template(messages, add_generation_prompt, tokenize):
            text = messages[0]["content"][0]["text"]
            return f"<s>user: {text}</u>\nassistant:" if add_generation_prompt else f"<s>user: {text}</u>"

    class Plain:
        @staticmethod
        def apply_chat_template(*args, **kwargs):
            raise ValueError("no chat template")

    assert generation_suffix(Chat()) == "</u>\nassistant:"
    assert generation_suffix(Plain()) == ""


def test_retrieved_words_are_the_answer_words_the_question_does_not_give():
    q = question_of(NEEDLE, CHATML)
    assert words("The Number, of YARA is 92736.") == ["the", "number", "of", "yara", "is", "92736"]
    assert retrieved_words("The number of Yara is 92736.", q) == ["92736"]
    assert retrieved_words("It is 92736, then 92736 and 11.", q) == ["it", "92736", "then", "and", "11"]
    assert retrieved_words("The number of Yara.", q) == []


def test_recall_is_the_share_of_retrieved_words_in_the_candidates_answer():
    q = question_of(NEEDLE, CHATML)
    full = "The number of Yara is 92736."
    # #38's case: the reworded answer keeps the value, the echo of the full cache's words does not
    assert answer_recall(full, "The answer to this puzzle is: 92736.", q) == 1.0
    assert answer_recall(full, "The secret number of Yara is 784.", q) == 0.0
    assert answer_recall("Codes 7042 and 5683.", "code 7042", "What is the code?") == pytest.approx(1 / 4)
    assert answer_recall("Codes 7042 and 5683.", "codes 7042 and 5683", "What?") == 1.0


def test_a_word_the_prompt_repeats_weighs_less_than_one_it_gives_once():
    prompt = "Ann has code 11. Bob has code 22. Cy has code 33. Ann is tall."
    assert rarity_weights(["has", "ann", "bob", "zed"], prompt) == [1 / 4, 1 / 3, 1 / 2, 1.0]
    assert rarity_weights(["has", "zed"], "") == [1.0, 1.0]
    full, q = "Bob has 22.", "What is Bob's code?"  # retrieved: has (3 times in the prompt), 22 (once)
    assert answer_recall(full, "22", q, prompt) == pytest.approx((1 / 2) / (1 / 4 + 1 / 2))
    assert answer_recall(full, "has", q, prompt) == pytest.approx((1 / 4) / (1 / 4 + 1 / 2))
    assert answer_recall(full, "22", q) == answer_recall(full, "has", q) == 0.5  # no prompt: unweighted


def test_on_a_catalogue_the_description_without_the_code_scores_low():
    colours = ["red", "green", "blue", "purple", "yellow"]
    shapes = ["circle", "square", "cross", "star"]  # 20 lines, like smol_codes' catalogue
    lines = [
        f"The {c} {s} has code {1000 + 7 * i}."
        for i, (c, s) in enumerate((c, s) for c in colours for s in shapes)
    ]
    prompt = "Here is the catalogue:\n" + "\n".join(lines) + "\nWhat is the code of the object in the image?"
    q = question_of(prompt)
    full = "The red circle has code 1000."  # retrieved: red (x4), circle (x5), has (x20), 1000 (once)
    assert retrieved_words(full, q) == ["red", "circle", "has", "1000"]
    described = answer_recall(full, "The red circle has code 1063.", q, prompt)
    assert answer_recall(full, "The red circle has code 1063.", q) == 0.75  # unweighted: the description
    assert described < 0.5 < answer_recall(full, "Code 1000.", q, prompt)
    assert answer_recall(full, full, q, prompt) == 1.0


def test_without_retrieved_words_recall_is_whole_normalized_answer_equality():
    q = "Is the square red?"
    assert answer_recall("Yes.", "yes", "Is it? Yes or no.") == 1.0
    assert answer_recall("The square is red.", "the SQUARE is red!", q) == 1.0
    assert answer_recall("The square is red.", "The square is red, is red.", q) == 0.0
    assert answer_recall("", "", q) == 1.0 and answer_recall("", "red", q) == 0.0


def _rows(spec) -> list[dict]:
    policies = dict(CANDIDATES)
    out = []
    for label, agreement, kl, recall in spec:
        row = {"candidate": label, "budget": 0.02, "agreement": agreement, "kl": kl, "prompts": 10}
        row["policy"] = policy_from_dict(policies[label]).to_dict()
        out.append(row | ({} if recall is None else {"recall": recall}))
    return out


LABELS = [label for label, _ in CANDIDATES]
SCRIPT = [  # (candidate, agreement, kl, recall): recall only on the re-ranked rows
    (LABELS[0], 0.57, 1.0, 0.5),  # the default: reworded answers that keep the value
    (LABELS[1], 0.85, 0.5, 0.25),  # the best agreement: echoes the words, loses the value
    (LABELS[2], 0.80, 0.4, 0.5),  # ties the default on recall with a higher agreement
    (LABELS[3], 0.70, 0.3, None),  # not re-ranked
    (LABELS[4], 0.90, 0.2, None),  # measured on fewer prompts (a screening cut it)
]


def test_the_ranking_with_the_rule_off_and_on():
    rows = _rows(SCRIPT)
    rows[4]["prompts"] = 4
    assert rerank_set(rows, [0.02], 2) == {0.02: {LABELS[1], LABELS[2], LABELS[0]}}
    assert rerank_set(rows, [0.02], 1) == {0.02: {LABELS[1], LABELS[0]}}
    assert best_per_budget(rows, [0.02])[0].candidate == LABELS[1]  # off: agreement first
    assert best_per_budget(rows, [0.02], by_recall=True)[0].candidate == LABELS[2]  # recall, then agreement
    rows[0]["recall"] = 0.75
    assert best_per_budget(rows, [0.02], by_recall=True)[0].candidate == LABELS[0]
    for r in rows:  # without a recall column the rule is the old one
        r.pop("recall", None)
    assert best_per_budget(rows, [0.02], by_recall=True)[0].candidate == LABELS[1]


def _profile(rows) -> dict:
    entry = ProfileEntry(0.02, "default", policy_from_dict(PRESETS["vlcache_default"]))
    return CompressionProfile(
        {"fingerprint": "fp"}, {"digest": "d", "count": 10}, {}, [entry], rows
    ).to_dict()


def test_the_recall_column_is_optional_validated_and_shown():
    rows = _rows(SCRIPT[:4])
    profile = profile_from_dict(_profile(rows))
    lines = format_table(profile).splitlines()
    assert "0.02: recall / agreement / KL" in lines[0]
    assert lines[2] == f"| {LABELS[0]} | 0.50 / 0.570 / 1.000 * |"  # the entry, starred
    assert lines[5] == f"| {LABELS[3]} | - / 0.700 / 0.300 |"
    for r in rows:
        r.pop("recall", None)
    old = profile_from_dict(_profile(rows))  # a profile written before the column
    assert "recall" not in format_table(old)
    for bad in (1.5, -0.1, "all"):
        with pytest.raises(ValueError, match=r"table\[0\]\.recall"):
            profile_from_dict(_profile([{**rows[0], "recall": bad}]))


def test_a_reranked_calibration_writes_recall_for_the_re_ranked_rows_and_traces_it(tmp_path):
    processor = load_processor(str(DEFAULT_MODEL_DIR))
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        processor,
        synthetic_task.make_examples(2, seed=3, split="train"),
        synthetic_task,
    )
    path, profile, _ = calibrate(
        str(DEFAULT_MODEL_DIR), str(prompts), (0.1,), tokens=4, out=str(tmp_path / "p.json"),
        trace=str(tmp_path / "t.jsonl"), rerank=1,
    )  # fmt: skip
    reranked = [r for r in read_profile(path).table if "recall" in r]
    assert {r["candidate"] for r in reranked} == rerank_set(profile.table, (0.1,), 1)[0.1]
    assert all(0.0 <= r["recall"] <= 1.0 for r in reranked) and profile.measure["rerank"] == 1
    assert profile.entries[0].candidate in {r["candidate"] for r in reranked}
    for line in (tmp_path / "t.jsonl").read_text().splitlines():
        cells = json.loads(line)
        assert all(len(cells[f"{r['candidate']}|0.1"]) == 3 for r in reranked)
    assert "recall / exact / agreement / KL" in format_table(profile)
