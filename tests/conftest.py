"""pytest's hook for tests/unit and tests/integration. In pytest's default "prepend" import mode this folder is put
on ``sys.path``, so the support modules here (``fixtures``, ``inproc_cluster``, ...) import by their names."""

import vlkv.deploy  # noqa: F401 - before transformers: keeps the checkout's root off sys.path
from fixtures import calibrated_profile, tiny_model_dirs  # noqa: F401 - the shared fixtures
