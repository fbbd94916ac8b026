"""Plain-JSON dicts for the compression parts (allocators, policies), checked on the way in.

Every part is a dataclass whose fields all have defaults; a field's type is the type of its default
(``bool``, ``int``, ``float``; a float field accepts an int). :func:`fields_from_dict` refuses unknown keys
and values of the wrong type with a ValueError that names the part and the key; range checks stay in each
part's ``__post_init__`` (also a ValueError), so a dict and a constructor call are validated the same way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def fields_to_dict(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{field: value}`` of a dataclass instance (scalars only), leaving out ``skip``."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in skip}


def check_keys(data: Any, known: set[str] | tuple[str, ...], what: str) -> None:
    """ValueError unless ``data`` is a dict whose keys are all in ``known``."""
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"{what}: unknown option(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}"
        )


def scalar(value: Any, like: Any, what: str) -> Any:
    """``value`` checked against the type of the default ``like`` (bool / int / float / str)."""
    if isinstance(like, bool):
        ok = isinstance(value, bool)
    elif isinstance(like, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(like, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, type(like))
    if not ok:
        raise ValueError(f"{what}: expected {type(like).__name__}, got {value!r}")
    return value


def fields_from_dict(
    cls: type, data: dict[str, Any], what: str, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Constructor keywords for dataclass ``cls`` from ``data`` (every key a field of ``cls``, not in
    ``skip``, with a value of the field's default's type). ValueError names ``what`` and the key."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    check_keys(data, set(fields), what)
    out = {}
    for key, value in data.items():
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[key] = scalar(value, default, f"{what}.{key}")
    return out
