"""Protocol v2.1 (v2.2: its tie rule, ``protocol_ties.py``): the default chosen per prompt kind (``common/compression/README.md``, "Protocol v2.1").

``text_preset`` hands text-only prompts to a preset and leaves image prompts bitwise unchanged: image members
carry no evidence about it, and once a preset governs text-only prompts the image options say nothing about
them. v2 scored one flat set of candidates over every member; v2.1 decides two dimensions, in this order:

- **text** (``decide_text``): the current default and the rows whose recorded config (the JSON's
  ``configs``) differs from the current default's only in ``text_preset``; v2's rules
  (``protocol_rules.decide``) over the real-text tasks that count and nothing else, the held-out check on
  every text task at every budget. Besides, on every image member whose held-out split ran both rows, the
  preset's row must give the current default's answers (per example): a row that does not is flagged and
  not adopted. Fewer than two text tasks (or image members, for the image one): not decidable (no member can be left out), nothing adopted.
- **image** (``decide_image``): v2 over the rows that set no text preset of their own (today: every row but
  ``text_preset``'s) and the image members; the text tasks take part (scores, folds, held-out checks) only
  when the text dimension adopted no preset. With a preset adopted the preset compresses text-only prompts
  whatever the other options say, so the text tasks have nothing to say about those options; without one,
  an image option also changes text-only prompts and must hold there too. No image member in the files:
  the image dimension is not decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlkv_lab.eval.protocol_rules import (
    BUDGETS,
    Choice,
    Decision,
    candidates,
    checked_v2,
    choose,
    counting,
    current_label,
    decide,
)
from vlkv_lab.eval.protocol_ties import configs_of, is_text

NO_IMAGE_EVIDENCE = "no image evidence in these files: not rerun"
EQUAL, DIFFERS, NOT_MEASURED = "equal", "differs", "not measured"


def preset_of(config: dict) -> str:
    return (config.get("params") or {}).get("text_preset") or ""


def text_rows(configs: dict, current: str) -> list[str]:
    """Rows whose recorded config differs from ``current``'s only in ``text_preset`` (compared as recorded,
    so a file is read as it was run even after the default changes)."""
    base = configs.get(current)
    if base is None:
        return []

    def rest(c: dict):
        return c.get("policy"), {k: v for k, v in (c.get("params") or {}).items() if k != "text_preset"}

    return [
        label
        for label, c in configs.items()
        if label != current and preset_of(c) and preset_of(c) != preset_of(base) and rest(c) == rest(base)
    ]


def same_answers(r: dict, label: str, base: str) -> str:
    """``EQUAL`` when ``label`` and ``base`` are right on the same examples at every budget both ran (their
    accuracies when no per-example hits were saved), ``DIFFERS`` otherwise; ``NOT_MEASURED`` when either row
    (or any shared budget) is missing."""
    hits, rows = r.get("hits", {}), r.get("rows", {})
    if label not in rows or base not in rows:
        return NOT_MEASURED
    shared = sorted(set(rows[label]) & set(rows[base]))
    if not shared:
        return NOT_MEASURED
    for b in shared:
        h, g = hits.get(label, {}).get(b), hits.get(base, {}).get(b)
        same = h == g if h is not None and g is not None else rows[label][b] == rows[base][b]
        if not same:
            return DIFFERS
    return EQUAL


def image_check(heldout: dict, rows, current: str) -> dict:
    """``{member: {row: EQUAL | DIFFERS | NOT_MEASURED}}`` over the held-out image members (every one,
    eviction-trained included: image prompts must be unchanged on any model)."""
    return {
        name: {x: same_answers(r, x, current) for x in rows}
        for name, r in heldout.items()
        if not is_text(name)
    }


@dataclass
class Dimension:
    kind: str  # "text" or "image"
    members: list[str]  # scored and left out one at a time
    labels: list[str]  # candidates, the current default included
    current: str
    choice: Choice | None = None  # the scores on every member (also when not decidable, if any member)
    decision: Decision | None = None  # None when not decided (``note`` says why)
    note: str = ""
    image_check: dict = field(default_factory=dict)  # text only: ``image_check``'s result
    texts_judge: bool = True  # image only: whether the text tasks take part
    preset: str = ""  # text only: the adopted row's ``text_preset`` ("" when none is adopted)

    @property
    def adopted(self) -> bool:
        return self.decision is not None and self.decision.adopted


def _text_checked(name: str, r: dict) -> bool:
    return is_text(name) and "dropped" not in r


def decide_text(train: dict, heldout: dict, budgets=BUDGETS) -> Dimension:
    current = current_label(train)
    names = [n for n in counting(train) if is_text(n)]
    configs = configs_of(train) or configs_of(heldout)
    rows = text_rows(configs, current)
    labels = [x for x in candidates(train, names) if x == current or x in rows] if names else []
    dim = Dimension("text", names, labels, current, image_check=image_check(heldout, rows, current))
    if names and labels:
        dim.choice = choose(train, names, labels, budgets, "text")
    if len(names) < 2:
        dim.note = f"not decidable: {len(names)} text member{'' if len(names) == 1 else 's'}"
        return dim
    if current not in labels or len(labels) < 2:
        dim.note = "not decidable: no text-preset row (or no current default) on every text member"
        return dim
    d = decide(train, heldout, budgets, names, labels, checked=_text_checked, kind="text")
    flagged = [m for m, by in dim.image_check.items() if by.get(d.choice.label) == DIFFERS]
    if flagged:
        d.reasons.append(
            f"`{d.choice.label}` differs from the current default on image members (image prompts must be "
            "unchanged): " + ", ".join(flagged)
        )
        d.adopted = False
    dim.decision = d
    dim.preset = preset_of(configs[d.choice.label]) if d.adopted else ""
    return dim


def decide_image(train: dict, heldout: dict, text_adopted: bool, budgets=BUDGETS) -> Dimension:
    current = current_label(train)
    counted = counting(train)
    images = [n for n in counted if not is_text(n)]
    names = images if text_adopted or not images else counted
    configs = configs_of(train) or configs_of(heldout)
    own = preset_of(configs.get(current, {}))
    labels = [x for x in candidates(train, names) if preset_of(configs.get(x, {})) == own] if images else []
    dim = Dimension("image", names, labels, current, texts_judge=not text_adopted)
    if not images:
        dim.note = NO_IMAGE_EVIDENCE
        return dim
    if not labels:
        dim.note = "not decidable: no candidate row on every image member"
        return dim
    if len(names) < 2:  # no member can be left out: the scores are shown, nothing is adopted
        dim.choice = choose(train, names, labels, budgets, "image")
        dim.note = f"not decidable: {len(names)} member"
        return dim

    def checked(name: str, r: dict) -> bool:
        return checked_v2(name, r) and not (text_adopted and is_text(name))

    dim.decision = decide(train, heldout, budgets, names, labels, checked=checked, kind="image")
    dim.choice = dim.decision.choice
    return dim


def decide_kinds(train: dict, heldout: dict, budgets=BUDGETS) -> tuple[Dimension, Dimension]:
    """The text dimension, then the image dimension given whether the text one adopted a preset."""
    text = decide_text(train, heldout, budgets)
    return text, decide_image(train, heldout, text.adopted, budgets)
