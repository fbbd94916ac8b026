"""The kvpress text-suite run's answer length: one cap for every prompt, or a cap per task (RULER's tasks echo
their longer question before the answer, ``text_suite.max_new_tokens``), on a tiny random Llama without kvpress."""

from __future__ import annotations

from tiny_llama import tiny_llama
from vlkv_lab.eval.kvpress_suite import Prompt, run
from vlkv_lab.zoo import text_suite


class _Chars:
    """A tokenizer of one id per character (ids 2..61); decodes to the ids joined by spaces."""

    eos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [2 + ord(ch) % 60 for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _prompts():
    return [
        Prompt(task, 1024, f"context {task} then the question?", "the question?")
        for task in ("needle", "niah_single_1")
    ]


def _full_lengths(max_new_tokens) -> dict[str, int]:
    model = tiny_llama(2)
    model.generation_config.eos_token_id = None  # no end of turn: every answer runs to its cap
    records = run(
        model,
        _Chars(),
        _prompts(),
        lambda text, item: False,
        budgets=[0.1],
        presses=[],
        modes=["prompt"],
        max_new_tokens=max_new_tokens,
        kvpress=object(),
        progress=False,
    )
    return {r["task"]: len(r["answer"].split()) for r in records if r["press"] == "full"}


def test_one_cap_for_every_prompt():
    assert _full_lengths(5) == {"needle": 5, "niah_single_1": 5}


def test_a_cap_per_task_gives_ruler_tasks_their_longer_answers():
    lengths = _full_lengths(lambda task: 3 if task == "needle" else 7)
    assert lengths == {"needle": 3, "niah_single_1": 7}
    # the bench's function: RULER's tasks get more than the suite's own
    assert text_suite.max_new_tokens("niah_single_1") > text_suite.max_new_tokens("needle")
