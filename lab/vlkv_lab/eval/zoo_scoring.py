"""Scoring one chunk of prefilled examples for ``vlkv eval zoo``: every row at every budget, one prefill each.

``score_chunk`` decodes the full cache once, takes the oracle's answer attention from that answer
(``oracle.py``), then per budget compresses every example with every ``(label, policy, params)`` row and the
two oracle rows and decodes all those caches together through the decode worker's core (``decode_batch``).
It returns which answers were right, per row and budget, so chunks add up and every figure keeps its n.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from vlkv.common.compression.registry import DEFAULT_POLICY

from vlkv_lab.eval.evaluation import Prepared, compress, decode_batch
from vlkv_lab.eval.oracle import answer_attention, mass_budgets, oracle_cache

FULL = "full"
ORACLE_DEFAULT = "oracle (default's budgets)"
ORACLE_OWN = "oracle (own budgets)"
ORACLES = (ORACLE_DEFAULT, ORACLE_OWN)
DECODE_CHUNK = 1000
"""Compressed caches decoded in one batch at most (every row and oracle of a chunk at one budget)."""


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n`` (95% for z = 1.96)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def score_chunk(
    model,
    processor,
    prepared: list[Prepared],
    configs: list[tuple[str, str, dict]],
    budgets: Iterable[float],
    max_new_tokens: int,
    oracle: bool = True,
    texts: dict | None = None,
    decode_chunk: int = DECODE_CHUNK,
) -> dict[str, dict[str, list[bool]]]:
    """``{row: {str(budget): [right per example]}}`` with ``FULL`` under ``"1.0"``.

    configs: ``(label, policy, params)`` rows; the default policy's per-layer budgets (its row when
    ``configs`` has one labelled ``DEFAULT_POLICY``) are the first oracle row's. texts: filled with the
    answers, ``{row: {str(budget): [text]}}`` (the ``--api`` check compares the default's)."""
    full_ids, right = full_answers(model, processor, prepared, max_new_tokens, texts)
    right |= score_rows(
        model, processor, prepared, full_ids, configs, budgets, max_new_tokens, oracle, texts, decode_chunk
    )
    return right


def full_answers(
    model,
    processor,
    prepared,
    max_new_tokens: int,
    texts: dict | None = None,
    chunk: int = 600,
    batch_invariant: bool = False,
):
    """``(token ids, {FULL: {"1.0": [right]}})`` of the full cache's greedy answers (``chunk`` at a time;
    ``batch_invariant``: decoded as ``vlkv serve --batch-invariant`` decodes)."""
    decode = _decoder(model, processor, max_new_tokens, chunk, batch_invariant)
    ids, answers = decode([compress(p, "full", 1.0) for p in prepared])
    if texts is not None:
        texts.setdefault(FULL, {})["1.0"] = answers
    return ids, {
        FULL: {"1.0": [p.task.is_correct(t, p.example) for p, t in zip(prepared, answers, strict=True)]}
    }


def score_rows(
    model,
    processor,
    prepared,
    full_ids,
    configs,
    budgets,
    max_new_tokens,
    oracle=True,
    texts=None,
    decode_chunk=DECODE_CHUNK,
    batch_invariant: bool = False,
) -> dict[str, dict[str, list[bool]]]:
    """Every row (and the oracles, from the answers ``full_ids``) at every budget; ``score_chunk``'s rows."""
    decode = _decoder(model, processor, max_new_tokens, decode_chunk, batch_invariant)
    attention = (
        [answer_attention(model, p, ids) for p, ids in zip(prepared, full_ids, strict=True)] if oracle else []
    )
    right: dict = {}
    for b in budgets:
        rows: list[tuple[str, list]] = []
        for label, policy, params in configs:
            rows.append((label, [compress(p, policy, b, **params) for p in prepared]))
        if oracle:
            default = dict(rows).get(DEFAULT_POLICY) or [compress(p, DEFAULT_POLICY, b) for p in prepared]
            own, at_default = [], []
            for p, att, c in zip(prepared, attention, default, strict=True):
                at_default.append(oracle_cache(p, att, c.layer_lengths))
                own.append(oracle_cache(p, att, mass_budgets(att, sum(c.layer_lengths))))
            rows += [(ORACLE_DEFAULT, at_default), (ORACLE_OWN, own)]
        if not rows:
            continue
        answers = _decode_unique(decode, [c for _, caches in rows for c in caches], len(prepared))
        for j, (label, _) in enumerate(rows):
            mine = answers[j * len(prepared) : (j + 1) * len(prepared)]
            right.setdefault(label, {})[str(b)] = [
                p.task.is_correct(t, p.example) for p, t in zip(prepared, mine, strict=True)
            ]
            if texts is not None:
                texts.setdefault(label, {})[str(b)] = mine
    return right


def _decode_unique(decode, caches: list, n: int) -> list[str]:
    """Answers of ``caches`` (rows of ``n`` examples each), decoding once the caches of one example that
    keep the same positions (two rows that choose alike: the same cache, so the same greedy answer)."""
    first: dict = {}
    where = []
    for j, c in enumerate(caches):
        key = (j % n, *(idx.cpu().numpy().tobytes() for idx in c.kept_indices)) if c.kept_indices else j
        where.append(first.setdefault(key, len(first)))
    unique = {i: c for c, i in zip(caches, where, strict=True)}
    _, answers = decode([unique[i] for i in range(len(unique))])
    return [answers[i] for i in where]


def _decoder(model, processor, max_new_tokens: int, chunk: int, batch_invariant: bool = False):
    eos = {processor.tokenizer.eos_token_id}

    def decode(caches):
        # as few batches as ``chunk`` allows, of even sizes (a small last batch costs as many steps)
        size = -(-len(caches) // max(1, -(-len(caches) // chunk))) if caches else 1
        ids = []
        for i in range(0, len(caches), size):
            ids += decode_batch(
                model, caches[i : i + size], max_new_tokens, eos, batch_invariant=batch_invariant
            )
        return ids, [processor.tokenizer.decode(o, skip_special_tokens=True) for o in ids]

    return decode


def merge(into: dict, part: dict) -> dict:
    """Append one chunk's ``score_chunk`` result to the running one."""
    for label, by_b in part.items():
        for b, hits in by_b.items():
            into.setdefault(label, {}).setdefault(b, []).extend(hits)
    return into
