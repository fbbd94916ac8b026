"""One definition of each default, whatever its settings: the policy a request naming vlcache gets is the
zoo's defaults row, the preset ``vlcache_default``, calibrate's and the verifier's "default" candidate; the
previous default is one preset shared by the zoo and calibrate; a text-only prompt goes to the default's text
preset whatever the image options, and an option row changes image prompts only."""

import vlkv_lab.eval.presets  # noqa: F401  (the lab's presets: the experiments this names)
from vlkv.common.compression import ByPromptKind, get_policy, preset
from vlkv.common.compression.registry import DEFAULT_TEXT_PRESET, policy_from_dict
from vlkv.common.compression.verify import VERIFY_CANDIDATES
from vlkv.deploy.calibrate.measure import CANDIDATES
from vlkv_lab.eval.zoo import ABLATION, PYRAMID_WINDOW, PYRAMID_WINDOW_LABEL

M = 300  # a prompt's length; tau = M: text-only, tau = 20: an image prompt


def _rows():
    return {label: get_policy(policy, **params) for label, policy, params in ABLATION}


def test_every_place_that_names_the_default_builds_the_same_policy():
    default = get_policy("vlcache")
    assert _rows()["vlcache (defaults)"] == default == get_policy() == preset("vlcache_default")
    assert policy_from_dict(dict(CANDIDATES)["default"]) == default
    assert policy_from_dict(dict(VERIFY_CANDIDATES)["default"]) == default
    assert policy_from_dict(default.to_dict()) == default  # and a profile that stores it reads it back


def test_the_previous_default_is_one_preset_shared_by_the_zoo_and_calibrate():
    previous = _rows()[PYRAMID_WINDOW_LABEL]
    candidate = policy_from_dict(dict(CANDIDATES)["previous default (pyramid, window on)"])
    assert (
        preset("vlcache_pyramid_window") == previous == candidate == get_policy("vlcache", **PYRAMID_WINDOW)
    )
    assert previous != get_policy("vlcache")


def test_a_text_only_prompt_goes_to_the_default_text_preset_whatever_the_image_options():
    text = preset(DEFAULT_TEXT_PRESET["vlcache"])
    for label, policy in _rows().items():
        params = dict(next(p for lb, _, p in ABLATION if lb == label))
        if policy.name != "vlcache" or "text_preset" in params:
            continue  # a baseline, or a row that names its text-only handling itself
        assert isinstance(policy, ByPromptKind), label
        assert policy.text == text and policy.for_prompt(M, M) == text.for_prompt(M, M), label
        assert policy.for_prompt(M, 20) == policy.image and policy.image.for_prompt(M, 20) is policy.image


def test_a_text_preset_row_changes_text_only_prompts_only():
    default = get_policy("vlcache")
    for label, name, params in ABLATION:
        if name != "vlcache" or set(params) != {"text_preset"} or not params["text_preset"]:
            continue
        policy = get_policy(name, **params)
        assert policy.for_prompt(M, 20) == default.for_prompt(M, 20), label
        assert policy.for_prompt(M, M) == preset(params["text_preset"]).for_prompt(M, M), label
    bare = get_policy("vlcache", text_preset="")  # no route: vlcache compresses every prompt itself
    assert bare.for_prompt(M, M) is bare and bare == default.image
