"""Policy names as a request names them (``CompressionParams.policy``) and how to build one."""

from __future__ import annotations

from typing import Any

from .base import Policy
from .full import FullPolicy
from .h2o import H2OPolicy
from .pyramidkv import PyramidKVPolicy
from .random_policy import RandomPolicy
from .snapkv import SnapKVPolicy
from .streamingllm import StreamingLLMPolicy
from .vlcache import VLCachePolicy
from .zipcache import ZipCachePolicy

_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        VLCachePolicy,
        StreamingLLMPolicy,
        H2OPolicy,
        ZipCachePolicy,
        SnapKVPolicy,
        PyramidKVPolicy,
        RandomPolicy,
        FullPolicy,
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = "vlcache"


def get_policy(name: str = DEFAULT_POLICY, *, allocator: str | None = None, **params: Any) -> Policy:
    """Build policy ``name`` (empty = vlcache) with dataclass ``params``.

    allocator: a registered allocator name (``allocators.allocator_names()``); None or "" keeps the
    policy's own.
    Unknown names or parameters raise ValueError.
    """
    cls = _POLICIES.get(name or DEFAULT_POLICY)
    if cls is None:
        raise ValueError(f"unknown compression policy {name!r}; choose from {POLICY_NAMES}")
    if allocator:
        params["allocator"] = allocator
    try:
        return cls(**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err
