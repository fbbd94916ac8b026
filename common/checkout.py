"""Keep a source checkout's root off ``sys.path``.

vlkv's top-level folders (``kernels/``, ``common/``, ``deploy/``, ...) are installed as ``vlkv.kernels``,
``vlkv.common``, ... A process whose ``sys.path`` holds the checkout's root also sees them under their bare
names, and those shadow installed distributions of the same name: transformers >= 5.25 imports the ``kernels``
distribution (Hugging Face's hub kernels) at import time and then finds this repository's ``kernels/``. The
root lands on ``sys.path`` whenever a process starts in it: ``python -m ...`` run there, and every Ray worker
of a driver started there (Ray prepends the driver's working directory to its workers' path).

The entry packages (``vlkv.deploy``, where the Ray actors live, and the lab's ``vlkv_lab``) call
:func:`drop_checkout_root` before anything imports transformers. An installed wheel has no checkout root, so
there it does nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# common/ -> the checkout's root for an editable install; site-packages/vlkv for a wheel.
_ROOT = Path(__file__).resolve().parent.parent


def checkout_root() -> Path | None:
    """The source checkout this vlkv runs from, or None for an installed wheel."""
    if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "kernels" / "__init__.py").is_file():
        return _ROOT
    return None


def _is_root(entry: str, root: Path) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == root
    except (OSError, RuntimeError, ValueError):  # an entry that is no path (a path hook's name, say)
        return False


def drop_checkout_root() -> None:
    """Remove every ``sys.path`` entry naming the checkout's root (``""`` too, when the cwd is that root)."""
    root = checkout_root()
    if root is not None:
        sys.path[:] = [entry for entry in sys.path if not _is_root(entry, root)]
