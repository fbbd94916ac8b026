"""The cache keyword follows the installed transformers: ``cache`` (5.24+) or ``past_key_values`` (older)."""

import functools
import inspect
import warnings

import torch


def test_the_keyword_is_the_one_the_forward_names():
    from vlkv.common.model.cache_kwarg import cache_arg, cache_kwarg

    def new(self, input_ids=None, cache=None, **kwargs): ...
    def old(self, input_ids=None, past_key_values=None, **kwargs): ...
    def neither(self, *args, **kwargs): ...

    @functools.wraps(new)
    def decorated(*args, **kwargs):
        return new(*args, **kwargs)

    assert cache_kwarg(new) == "cache" and cache_kwarg(decorated) == "cache"
    assert cache_kwarg(old) == cache_kwarg(neither) == "past_key_values"
    sentinel = object()
    assert cache_arg(type("M", (), {"forward": new})(), sentinel) == {"cache": sentinel}
    assert cache_arg(type("M", (), {"forward": old})(), sentinel) == {"past_key_values": sentinel}


def test_the_installed_llava_takes_its_cache_without_a_deprecation_warning():
    from transformers import DynamicCache, LlavaForConditionalGeneration
    from vlkv.common.model.cache_kwarg import cache_arg, cache_kwarg
    from vlkv_lab.task.tiny_llava import build_tiny

    name = cache_kwarg(LlavaForConditionalGeneration.forward)
    assert name in inspect.signature(LlavaForConditionalGeneration.forward).parameters
    _, _, cfg = build_tiny(["a", "b"], image_size=32, patch_size=8, hidden=32, layers=2, vision_hidden=32,
                           vision_heads=2)  # fmt: skip
    model = LlavaForConditionalGeneration(cfg).eval()
    cache = DynamicCache(config=model.config.text_config)
    ids = torch.tensor([[1, 5, 6, 7]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            model(input_ids=ids, **cache_arg(model, cache), use_cache=True)
    assert cache.get_seq_length() == ids.shape[1]  # the forward wrote into the cache it was given
