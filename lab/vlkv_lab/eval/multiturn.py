"""Multi-turn accuracy (issue #64): three-turn chats about the same images or the same document, per turn
the full cache, re-compression of the whole prompt for the turn's question (what a follow-up served from
the prefix cache gets), continuation on the previous turn's compact cache (``conversation: continue``) and
the oracle, at each budget, beside the realized ratio of each.

``python -m vlkv_lab.eval.multiturn --out DIR [--n 16] [--budgets 0.02,0.05,0.1] [--suites text,objects]``

Suites (held-out splits, never tuned on):

- ``text``: SmolLM2-135M-Instruct (the real pretrained decoder, the lab's text-only LLaVA wrapper), a
  RULER-style document of ``--length`` tokens (RULER's noise haystack) hiding three needles of three kinds
  (a number, a code, a word, each under its own key) at uniform depths; each turn asks one of them, in a
  drawn order. An answer is right when it holds that needle's value and no other needle's.
- ``objects``: the zoo member ``smol_objects`` (SmolLM2 with a trained vision tower), 3-4 images of one
  object each; each turn asks about another image's object (its colour or its shape), so every turn needs
  a different region of the prompt.

Every arm sees the same history: the earlier turns' questions and the full cache's answers (so what
differs between arms is the cache alone, not what an earlier wrong answer said). Per turn: ``full`` the
full cache; ``recompress`` the default policy over the whole prompt (the prefix cache hands the worker the
same K/V a cold prefill computes, ``tests/unit/test_prefix_cache.py``); ``continue`` the first turn's compact
cache with each later turn's new tokens appended (``prefill_worker.continuation.append_tokens``, as the
prefill worker continues; a prompt that does not extend the last one falls back to ``recompress`` and is
counted); ``verified`` continuation as a verified server serves it (``PrefillEngine.run_verified``): each
turn's continued cache is teacher-forced against the full cache's greedy draft and kept only when its
agreement meets the default floor, else the turn is re-compressed (the default policy, unverified here; the
chain carries on from whichever cache was kept; the held share is counted); ``oracle`` the cache the full answer itself attends to most, at the default's per-layer budgets
(``oracle.py``: a ceiling, not a policy). The ratio is the realized one: kept tokens over the prompt's, all
layers; a continued cache keeps every appended token, so its ratio grows per turn.

Prints the table, writes ``multiturn.md`` and ``multiturn.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from vlkv.common.compression.registry import DEFAULT_POLICY
from vlkv.common.compression.verify import DEFAULT_DRAFT_TOKENS, DEFAULT_FLOOR, VerifyPlan
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.forced import append_tokens
from vlkv.common.model.inputs import prepare_inputs
from vlkv.common.model.spec import ModelSpec
from vlkv.prefill_worker.draft_queries import run_draft
from vlkv.prefill_worker.verifier import check_continued

from vlkv_lab.eval.evaluation import compress, decode_batch, prepare
from vlkv_lab.eval.oracle import answer_attention, oracle_cache
from vlkv_lab.zoo import text_ruler
from vlkv_lab.zoo.text_suite import TextItem
from vlkv_lab.zoo.text_suite import is_correct as text_correct

TURNS = 3
ARMS = ("full", "recompress", "continue", "verified", "oracle")
PLAN = VerifyPlan("floor", DEFAULT_FLOOR, 1.0, DEFAULT_DRAFT_TOKENS)  # the server's default floor and draft
KINDS = ("number", "code", "word")


@dataclass(frozen=True)
class Chat:
    """One conversation: its images (none for text), the first turn's preamble (the document), and per
    turn the question and what scores its answer (a ``TextItem`` or a zoo ``Example``)."""

    images: tuple
    preamble: str
    questions: tuple[str, ...]
    scored: tuple[Any, ...]


@dataclass(frozen=True)
class TurnExample:
    """One turn's prompt as ``evaluation.prepare`` takes it: the chat so far, and what scores the answer."""

    images: list
    messages: list[dict]
    scored: Any


class TurnTask:
    """The task interface ``prepare`` and the scoring read, over a base scorer ``correct(text, scored)``."""

    def __init__(self, correct) -> None:
        self._correct = correct

    def prompt_text(self, processor, ex: TurnExample) -> str:
        return processor.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)

    def is_correct(self, text: str, ex: TurnExample) -> bool:
        return self._correct(text, ex.scored)


def messages(chat: Chat, turn: int, answers: list[str]) -> list[dict]:
    """The chat up to ``turn``'s question: earlier questions with ``answers`` (the full cache's)."""
    out = []
    for t in range(turn + 1):
        content = [{"type": "image"} for _ in chat.images] if t == 0 else []
        text = f"{chat.preamble}\n\n{chat.questions[t]}" if t == 0 and chat.preamble else chat.questions[t]
        out.append({"role": "user", "content": content + [{"type": "text", "text": text}]})
        if t < turn:
            out.append({"role": "assistant", "content": [{"type": "text", "text": answers[t]}]})
    return out


def text_chats(tokenizer, n: int, length: int, seed: int = 0) -> list[Chat]:
    """``n`` documents of about ``length`` tokens, three needles each (held-out split's stream)."""
    chats = []
    for i in range(n):
        rng = random.Random(f"vlkv-multiturn/heldout/{length}/{seed}/{i}")
        keys = text_ruler.distinct(text_ruler.key, rng, len(KINDS))
        values = [text_ruler.number(rng), text_ruler.code(rng), rng.choice(text_ruler.VALUE_WORDS)]
        facts = [text_ruler.needle(k, v, kind) for k, v, kind in zip(keys, values, KINDS, strict=True)]
        order = rng.sample(range(len(KINDS)), TURNS)
        questions = tuple(text_ruler.ask(keys[j], KINDS[j]) for j in order)
        frame = tokenizer.apply_chat_template(
            [{"role": "user", "content": " ".join(facts) + "\n\n" + questions[0]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        room = length - len(tokenizer(frame, add_special_tokens=False)["input_ids"])
        filler = text_ruler.noise(
            room, lambda s: len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        )
        depths = sorted(rng.randint(0, len(filler)) for _ in facts)
        for j, (depth, fact) in enumerate(zip(depths, rng.sample(facts, len(facts)), strict=True)):
            filler.insert(depth + j, fact)
        context = " ".join(filler)
        scored = tuple(
            TextItem(
                "multiturn",
                length,
                "heldout",
                i,
                context,
                questions[t],
                values[j],
                wrong=tuple(v for v in values if v != values[j]),
            )  # fmt: skip
            for t, j in enumerate(order)
        )
        chats.append(Chat((), context, questions, scored))
    return chats


def object_chats(n: int, seed: int = 0) -> list[Chat]:
    """``n`` held-out ``smol_objects`` scenes (3-4 images); the turns ask about three different images."""
    from vlkv_lab.zoo import smol_objects

    chats = []
    for i in range(n):
        ex = smol_objects.make_example(i, seed, "heldout")
        rng = random.Random(f"vlkv-multiturn/objects/{seed}/{i}")
        which = rng.sample(range(len(ex.images)), TURNS)
        questions, scored = [], []
        for w in which:
            obj = ex.objects[w][0]
            kind = rng.choice(smol_objects.KINDS)
            q, a = smol_objects._question(kind, obj)
            questions.append(q)
            scored.append(
                replace(ex, question=q, answer=a, target=a, category=kind, kind=kind, focus=[(w, obj)])
            )
        chats.append(Chat(tuple(ex.images), "", tuple(questions), tuple(scored)))
    return chats


def _ids(processor, spec: ModelSpec, task: TurnTask, ex: TurnExample) -> list[int]:
    inputs = prepare_inputs(processor, ex.images, task.prompt_text(processor, ex), spec.image_token_id)
    return inputs.input_ids.reshape(-1).tolist()


def _score(model, processor, prepared, caches: list[CompactKV], max_new: int):
    """``(right, texts, token ids)`` of the caches' greedy answers, decoded together."""
    outs = decode_batch(model, caches, max_new, {processor.tokenizer.eos_token_id})
    texts = [processor.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
    return [p.task.is_correct(t, p.example) for p, t in zip(prepared, texts, strict=True)], texts, outs


def run_suite(model, processor, chats: list[Chat], task: TurnTask, budgets, max_new: int, log=print) -> dict:
    """``{turn: {budget: {arm: {"right": [...], "ratio": mean}}}}`` plus the fallbacks of ``continue`` and,
    per turn and budget, how many ``verified`` continued caches held (``"held"``)."""
    spec = ModelSpec.from_model(model, processor.tokenizer)
    answers: list[list[str]] = [[] for _ in chats]
    carried: dict[float, list[CompactKV]] = {}
    checked: dict[float, list[CompactKV]] = {}
    last_ids: list[list[int]] = [[] for _ in chats]
    out: dict = {"turns": {}, "fallbacks": 0, "n": len(chats)}
    for turn in range(TURNS):
        t0 = time.perf_counter()
        exs = [
            TurnExample(list(c.images), messages(c, turn, answers[i]), c.scored[turn])
            for i, c in enumerate(chats)
        ]
        ids = [_ids(processor, spec, task, ex) for ex in exs]
        prepared = prepare(model, processor, exs, progress=False, task=task, next_attention=False)
        full = [compress(p, "full", 1.0) for p in prepared]
        right_full, texts, full_ids = _score(model, processor, prepared, full, max_new)
        attention = [answer_attention(model, p, a) for p, a in zip(prepared, full_ids, strict=True)]
        eos = spec.eos_token_ids
        drafts = (
            [
                run_draft(model, p.keys, p.values, p.first_token, PLAN.draft_tokens, eos, logprobs=True)
                for p in prepared
            ]
            if turn
            else []
        )
        rows: dict = {}
        for b in budgets:
            rc = [compress(p, DEFAULT_POLICY, b) for p in prepared]
            orc = [
                oracle_cache(p, att, c.layer_lengths)
                for p, att, c in zip(prepared, attention, rc, strict=True)
            ]
            cont, ver, held = (rc, rc, 0) if turn == 0 else ([], [], 0)
            for i in range(len(chats)) if turn else ():
                n = len(last_ids[i])
                if ids[i][:n] != last_ids[i] or len(ids[i]) <= n:  # not an extension: served as recompress
                    out["fallbacks"] += 1
                    cont.append(rc[i])
                    ver.append(rc[i])
                    continue
                ckv, logits = append_tokens(model, carried[b][i], ids[i][n:])
                ckv.first_token = int(logits.argmax())
                cont.append(ckv)
                checked_ckv, _ = append_tokens(model, checked[b][i], ids[i][n:])
                checked_ckv.first_token = prepared[i].first_token  # the full cache's, as the server's
                ok, _ = check_continued(model, checked_ckv, PLAN, b, drafts[i])
                held += ok
                ver.append(checked_ckv if ok else rc[i])
            carried[b], checked[b] = cont, ver
            cell = {"full": {"right": right_full, "ratio": 1.0, "texts": texts}, "held": held}
            for arm, caches in (("recompress", rc), ("continue", cont), ("verified", ver), ("oracle", orc)):
                right, arm_texts, _ = _score(model, processor, prepared, caches, max_new)
                ratio = sum(c.compression_ratio for c in caches) / len(caches)
                cell[arm] = {"right": right, "ratio": ratio, "texts": arm_texts}
            rows[str(b)] = cell
        out["turns"][str(turn + 1)] = rows
        out.setdefault("prompt_tokens", []).append(sum(p.m for p in prepared) / len(prepared))
        for i, t in enumerate(texts):
            answers[i].append(t.strip())
        last_ids = ids
        del prepared, attention
        log(f"  turn {turn + 1}: {time.perf_counter() - t0:.0f} s, full {sum(right_full)}/{len(chats)}")
    return out


def table(results: dict) -> str:
    """One markdown table per suite: per turn and budget, each arm's accuracy (right/n) and realized ratio."""
    lines = []
    for suite, r in results.items():
        lines += [f"### {suite} (n = {r['n']}, continue fell back {r['fallbacks']} times)", ""]
        lines += [
            "| turn | budget | full | recompress | continue | verified continue | held | oracle |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for turn, rows in r["turns"].items():
            for b, cell in rows.items():
                parts = []
                for arm in ARMS:
                    c = cell[arm]
                    acc = sum(c["right"]) / len(c["right"])
                    parts.append(f"{acc:.2f}" if arm == "full" else f"{acc:.2f} ({c['ratio']:.3f})")
                    if arm == "verified":
                        parts.append(f"{cell['held']}/{len(c['right'])}" if turn != "1" else "-")
                lines.append(f"| {turn} | {float(b):.0%} | " + " | ".join(parts) + " |")
        lines.append("")
    lines.append(
        "accuracy (realized ratio: kept tokens over the prompt's, all layers); held: verified continued caches"
        f" that met the floor {PLAN.floor} on a {PLAN.draft_tokens}-token draft (the rest re-compressed)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/eval_multiturn")
    p.add_argument("--n", type=int, default=16, help="conversations per suite")
    p.add_argument("--budgets", default="0.02,0.05,0.1")
    p.add_argument("--suites", default="text,objects", help="text, objects or both")
    p.add_argument("--length", type=int, default=1024, help="text: the document's tokens")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    budgets = [float(b) for b in args.budgets.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, t0 = {}, time.perf_counter()
    for suite in args.suites.split(","):
        print(f"{suite}:", flush=True)
        if suite == "text":
            from vlkv_lab.eval.zoo_text import load_text_model

            model, processor = load_text_model()
            chats = text_chats(processor.tokenizer, args.n, args.length)
            name = f"text: SmolLM2-135M, three needles in {args.length} tokens"
            results[name] = run_suite(
                model, processor, chats, TurnTask(text_correct), budgets, text_ruler.MAX_NEW_TOKENS
            )
        elif suite == "objects":
            from vlkv_lab.zoo import member
            from vlkv_lab.zoo.accuracy import load_member

            m = member("smol_objects")
            model, processor = load_member(m)
            name = "objects: smol_objects (SmolLM2 + vision tower), 3-4 images"
            results[name] = run_suite(
                model, processor, object_chats(args.n), TurnTask(m.is_correct), budgets, m.max_new_tokens
            )
        else:
            raise SystemExit(f"unknown suite {suite!r}: text, objects")
    md = table(results) + f"\n\npolicy {DEFAULT_POLICY}; {time.perf_counter() - t0:.0f} s\n"
    (out / "multiturn.md").write_text(md)
    (out / "multiturn.json").write_text(json.dumps(results, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
