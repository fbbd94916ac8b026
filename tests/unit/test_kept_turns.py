"""The gateway's record of kept conversation turns (``services/kept_turns.py``): a follow-up finds the turn it
continues only within its tenant, with the same images, when it starts with that turn's whole prompt and goes
past it; the positions kept stop where the prompt stops agreeing with the kept ids; entries are bounded and
forgotten with their worker."""

from __future__ import annotations

from vlkv.services.kept_turns import KeptTurn, KeptTurns

PROMPT = tuple(range(100, 120))  # a first turn's prompt
ANSWER = (7, 8, 9, 10)  # the tokens it produced and the cache holds


def _turn(key: str = "k", tenant: str = "t", images=("img",), address: str = "w1", ids=PROMPT + ANSWER):
    return KeptTurn(key, address, tenant, ids, len(PROMPT), len(PROMPT), tuple(images))


def test_a_follow_up_keeps_what_it_shares_with_the_kept_ids():
    kept = KeptTurns()
    kept.note(_turn())
    follow = [*PROMPT, *ANSWER, 50, 51]  # the answer rendered as sampled, then the next question
    turn, keep = kept.find("t", follow, ("img",))
    assert turn.key == "k" and keep == len(PROMPT) + len(ANSWER)
    other = [*PROMPT, 7, 8, 99, 50]  # the template renders the answer's end otherwise: cut back there
    assert kept.find("t", other, ("img",))[1] == len(PROMPT) + 2
    assert kept.find("t", [*PROMPT, *ANSWER], ("img",))[1] == len(PROMPT) + len(ANSWER) - 1  # one fed


def test_no_match_across_tenants_images_or_a_prompt_that_does_not_go_past_the_turn():
    kept = KeptTurns()
    kept.note(_turn())
    follow = [*PROMPT, *ANSWER, 50]
    assert kept.find("u", follow, ("img",)) is None  # another tenant
    assert kept.find("t", follow, ("other",)) is None  # another image, same ids
    assert kept.find("t", follow, ("img", "new")) is None  # a new image: decode steps cannot feed it
    assert kept.find("t", follow, ()) is None
    assert kept.find("t", list(PROMPT), ("img",)) is None  # not past the kept turn's prompt
    edited = [*PROMPT[:-1], 0, *ANSWER, 50]  # the first prompt edited: its compressed positions differ
    assert kept.find("t", edited, ("img",)) is None


def test_the_turn_sharing_the_most_positions_wins_and_dropping_forgets_it():
    kept = KeptTurns()
    kept.note(_turn("short", ids=PROMPT + ANSWER[:1]))
    kept.note(_turn("long"))
    assert kept.find("t", [*PROMPT, *ANSWER, 50], ("img",))[0].key == "long"
    kept.drop("long")
    assert kept.find("t", [*PROMPT, *ANSWER, 50], ("img",))[0].key == "short"
    kept.forget("w1")
    assert len(kept) == 0 and kept.find("t", [*PROMPT, *ANSWER, 50], ("img",)) is None


def test_entries_are_bounded_least_recently_noted_first():
    kept = KeptTurns(capacity=2)
    for i in range(3):
        kept.note(_turn(f"k{i}", tenant=f"t{i}"))
    assert len(kept) == 2 and kept.find("t0", [*PROMPT, *ANSWER, 1], ("img",)) is None
    assert kept.find("t2", [*PROMPT, *ANSWER, 1], ("img",))[0].key == "k2"


def test_entries_are_bounded_by_the_ids_they_hold():
    kept = KeptTurns(max_ids=2 * len(PROMPT + ANSWER) + 1)
    for i in range(3):
        kept.note(_turn(f"k{i}"))
    assert len(kept) == 2 and kept.find("t", [*PROMPT, *ANSWER, 1], ("img",))[0].key in ("k1", "k2")
    kept.note(_turn("huge", ids=PROMPT * 10))  # more than the bound alone: not kept, nothing dropped
    assert len(kept) == 2
