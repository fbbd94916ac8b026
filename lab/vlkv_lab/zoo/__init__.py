"""The model zoo: small trained LLaVA checkpoints that differ where compression policies are sensitive.

Lab only (``lab/vlkv_lab/``): the serving floors never import it; every member is served through the same
``load_model`` / ``from_pretrained`` path as a user's checkpoint.

A member is a module ``vlkv_lab.zoo.<name>`` whose ``MEMBER`` is a ``vlkv_lab.zoo.interface.Member``
(name, checkpoint directory, ``max_new_tokens``, a one-line ``geometry``, ``make_examples(n, seed, split)``,
the ``scored`` words of the one ``is_correct``, ``eviction_trained``), registered by name in ``MEMBERS``;
``member(name)`` returns it. Its training command is ``python -m vlkv_lab.zoo.<name> --out DIR``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlkv_lab.zoo.interface import Member

MEMBERS = ("default", "grid16", "longprompt", "next_anyres", "deep8", "smol_objects", "smol_codes")
"""Every member, the default model first."""


def member(name: str) -> Member:
    """The ``MEMBER`` of ``vlkv_lab.zoo.<name>`` (ValueError naming the members for an unknown name)."""
    if name not in MEMBERS:
        raise ValueError(f"unknown zoo member {name!r}; members: {', '.join(MEMBERS)}")
    return importlib.import_module(f"vlkv_lab.zoo.{name}").MEMBER
