"""The one trainer (lab/vlkv_lab/zoo/trainer.py): a stage trains what it declares, and nothing else, reproducibly."""

from __future__ import annotations

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration
from vlkv.deploy.synthetic_task import SHAPES, make_example
from vlkv_lab.zoo.batching import consecutive
from vlkv_lab.zoo.trainer import Probe, Stage, set_determinism, train

VISION = ("model.vision_tower.", "model.multi_modal_projector.")


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(model, before, prefixes) -> set[bool]:
    return {not torch.equal(p, before[n]) for n, p in model.named_parameters() if n.startswith(prefixes)}


def _run(path, stages):
    set_determinism(0, 1)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    before = _snapshot(model)
    model, seconds, losses = train(model, AutoProcessor.from_pretrained(path), stages)
    return model, before, losses[0]  # one stage


def test_stages_train_what_they_declare_and_repeat_bit_for_bit(tiny_model_dirs):
    path = tiny_model_dirs("llava-gqa")
    tokens = (32 // 8) ** 2

    def batches(n):
        return consecutive(lambda i: make_example(i, 0, "train", kind="colour_of_shape"), 1)

    def targets(chats):
        return torch.zeros(sum(len(ex.images) for ex, _ in chats), tokens, 2, dtype=torch.long)

    probe = [Stage("probe", 1, 1e-2, batches, warmup=1, probe=Probe(1, len(SHAPES), targets))]
    model, before, losses = _run(path, probe)
    assert len(losses) == 1 and losses[0] > 0
    assert _changed(model, before, ("model.language_model.", "lm_head.")) == {False}  # the probe: vision only
    assert True in _changed(model, before, VISION)

    frozen = [Stage("decoder", 1, 1e-2, batches, warmup=1, frozen=VISION)]
    model, before, losses = _run(path, frozen)
    assert _changed(model, before, VISION) == {False}
    assert _changed(model, before, ("model.language_model.layers.",)) == {True}
    assert all(p.requires_grad for p in model.parameters())  # left trainable for the next stage
    _, _, again = _run(path, frozen)
    assert again == losses  # deterministic: the same losses to the bit
