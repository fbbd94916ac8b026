"""The image default protocol v2.1 adopted on 2026-11-28 (#38): draft-mass layer budgets with the first two
layers at least at the pyramid's, no question window kept outright; text-only prompts compressed as before,
and the zoo's option rows the same policies as before the change (files of both times compare)."""

import vlkv_lab.eval.presets  # noqa: F401  (the lab's presets: the experiments this names)
from vlkv.common.compression import DraftMass, Pyramid, Uniform, get_policy, preset
from vlkv.common.compression.registry import policy_from_dict
from vlkv.deploy.calibrate.measure import CANDIDATES
from vlkv_lab.eval.zoo import ABLATION, PYRAMID_WINDOW, PYRAMID_WINDOW_LABEL

ADOPTED = "allocator: draft mass (w 0.5, pyramid floor in layers 0-1) + window: none"


def _rows():
    return {label: get_policy(policy, **params) for label, policy, params in ABLATION}


def test_the_default_is_the_row_the_protocol_adopted():
    rows, default = _rows(), get_policy("vlcache")
    assert rows[ADOPTED] == default == rows["vlcache (defaults)"]
    assert default.allocator == DraftMass(weight=0.5, beta=4.0, floor_layers=2)
    previous = rows[PYRAMID_WINDOW_LABEL]
    assert previous != default and previous.allocator == Pyramid(beta=4.0) and previous.post_vision_window
    # one definition of the previous default: the preset, the zoo's row and calibrate's candidate
    candidate = policy_from_dict(dict(CANDIDATES)["previous default (pyramid, window on)"])
    assert preset("vlcache_pyramid_window") == previous == candidate
    assert previous == get_policy(
        "vlcache", allocator={"name": "pyramid", "beta": 4.0}, post_vision_window=True
    )


def test_option_rows_are_the_policies_they_were_before_the_change():
    rows = _rows()
    none = rows["window: none (the paper's recent window only)"]
    assert none.allocator == Pyramid(beta=4.0) and not none.post_vision_window
    cap = rows["window: cap 1/4"]
    assert (cap.allocator, cap.post_vision_window, cap.post_vision_cap) == (Pyramid(beta=4.0), True, 0.25)
    assert rows["allocator: pyramid, beta 2"].allocator == Pyramid(beta=2.0)
    uniform = rows["allocator: uniform"]
    assert uniform.allocator == Uniform() and uniform.post_vision_window
    first = rows["window: first layer only"]
    assert first.post_vision_window and first.post_vision_layers == 1 and first.allocator == Pyramid(beta=4.0)
    # a text-preset row is today's default with its preset: image prompts are the default's by construction
    lean = rows["text-only prompts: preset vlcache_text_lean"]
    assert lean.allocator == get_policy("vlcache").allocator and not lean.post_vision_window
    assert lean.text_preset == "vlcache_text_lean"


def test_text_only_prompts_compress_as_under_the_previous_default():
    """A text-only prompt goes to the preset, which pins its own allocator and window: the change of the
    image default leaves it as it was; an image prompt gets the new settings."""
    new, old = get_policy("vlcache"), get_policy("vlcache", **PYRAMID_WINDOW)
    m = 300
    text = preset("vlcache_text_by_budget")  # the text default since protocol v2.2 (held-out seed 5)
    assert new.for_prompt(m, m) == old.for_prompt(m, m) == text
    assert text.post_vision_window and text.allocator == Uniform()
    # with a budget, the preset's own switch applies: below 7.5% vlcache_text_lean_w24_skip32, from 7.5% the
    # preset itself (vlcache_text_span's fields but the switch's: tests/test_text_by_budget.py)
    assert new.for_prompt(m, m, 0.05) == preset("vlcache_text_lean_w24_skip32")
    assert new.for_prompt(m, m, 0.1) == text
    for name in ("vlcache_text_lean", "vlcache_text_lowbudget", "vlcache_lookup"):
        assert preset(name).post_vision_window, name
    assert new.for_prompt(m, 20) is new and old.for_prompt(m, 20) is old and new != old
