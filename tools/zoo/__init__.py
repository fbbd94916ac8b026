"""The model zoo: small trained LLaVA checkpoints that differ where compression policies are sensitive.

Lab only (``tools/``): the serving floors never import it; every member is served through the same
``load_model`` / ``from_pretrained`` path as a user's checkpoint.

A member is a module ``vlkv.tools.zoo.<name>`` (its own task and its training command) with:

- ``NAME: str`` and ``MODEL_DIR: pathlib.Path``: the shipped Hugging Face checkpoint (for new members
  ``tools/zoo/models/<name>/``);
- ``MAX_NEW_TOKENS: int``: enough for the longest answer plus eos;
- ``make_examples(n, seed=0, split="heldout") -> list[Example]``: deterministic, ``split`` is ``"train"`` or
  ``"heldout"`` (disjoint seed spaces). ``Example`` is ``vlkv.tools.task.synthetic_task.Example`` (images,
  question, answer, target, category, kind): the question is the text after the image(s) of a one-turn chat,
  exactly what ``vlkv.tools.client.build_request(images=..., question=...)`` sends through the public API;
  anything before the images (an instruction) comes from the checkpoint's own chat template;
- ``is_correct(generated_text, example) -> bool``;
- ``prompt_text(processor, example) -> str``: the rendered prompt (the chat template over ``example.messages``);
- ``GEOMETRY: str``: one line for the zoo table (vision tokens per image, layers, what the member stresses);
- ``python -m vlkv.tools.zoo.<name> --out DIR``: its one deterministic training command.
"""

from __future__ import annotations

import importlib
from types import ModuleType

MEMBERS = ("default", "grid16", "longprompt", "next_anyres", "deep8")
"""Every member, the default model first."""


def member(name: str) -> ModuleType:
    """The member module ``vlkv.tools.zoo.<name>`` (ValueError naming the members for an unknown name)."""
    if name not in MEMBERS:
        raise ValueError(f"unknown zoo member {name!r}; members: {', '.join(MEMBERS)}")
    return importlib.import_module(f"vlkv.tools.zoo.{name}")
