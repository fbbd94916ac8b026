"""Zoo member ``default``: the embedded default model on its own synthetic task (``tools/task``)."""

from __future__ import annotations

from pathlib import Path

from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.tools.task.synthetic_task import MAX_NEW_TOKENS, is_correct, make_examples, prompt_text

NAME = "default"
MODEL_DIR = Path(DEFAULT_MODEL_DIR)
GEOMETRY = "LLaVA-1.5, 576 vision tokens/image (24x24), 4 layers, GQA 4/2; 1-2 images, short question after"

__all__ = ["GEOMETRY", "MAX_NEW_TOKENS", "MODEL_DIR", "NAME", "is_correct", "make_examples", "prompt_text"]
