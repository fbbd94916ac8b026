"""Zoo member ``default``: the embedded default model on its own synthetic task (``lab/vlkv_lab/task``); trained by
``python -m vlkv_lab.task.train_default_model``, with an eviction-robust last stage."""

from __future__ import annotations

from pathlib import Path

from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.deploy.synthetic_task import DECIDING_WORDS, MAX_NEW_TOKENS, make_examples

from vlkv_lab.zoo.interface import Member

MEMBER = Member(
    name="default",
    model_dir=Path(DEFAULT_MODEL_DIR),
    max_new_tokens=MAX_NEW_TOKENS,
    geometry="LLaVA-1.5, 576 vision tokens/image (24x24), 4 layers, GQA 4/2; 1-2 images, short question after",
    make_examples=make_examples,
    scored=DECIDING_WORDS,
    eviction_trained=True,
)
