"""Running Triton kernels through the interpreter inside a full pytest run (shared by the kernel tests).

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function. A test module sets it before importing
triton, which suffices when it runs alone; in a full run an earlier import of ``transformers`` may already have
built ``triton.language`` in compiled mode, so ``kernel_module`` swaps those helpers for interpreted ones while
the module's tests run and reloads the kernel module.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def triton_interpreter():
    """Make ``triton.language``'s jit helpers interpreted, as ``TRITON_INTERPRET=1`` at import would."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    owners = [m for n, m in list(sys.modules.items()) if n.startswith("triton.language") and m is not None]
    swapped, saved = {}, []
    for owner in [*owners, tl.tensor]:
        for name, value in list(vars(owner).items()):
            if isinstance(value, JITFunction):
                saved.append((owner, name, value))
                setattr(owner, name, swapped.setdefault(id(value), InterpretedFunction(value.fn)))
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def kernel_module(name: str, kernel_attr: str):
    """Generator for a module-scoped fixture: kernel module ``name``, interpreted when INTERPRET is set."""
    if not INTERPRET:
        yield importlib.import_module(name)
        return
    from triton.runtime.interpreter import InterpretedFunction

    with triton_interpreter():
        mod = importlib.import_module(name)
        if not isinstance(getattr(mod, kernel_attr), InterpretedFunction):
            mod = importlib.reload(mod)
        yield mod
