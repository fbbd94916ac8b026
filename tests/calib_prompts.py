"""A ``vlkv calibrate`` prompts file for the calibrate tests: synthetic-task training examples rendered by
the default model's processor."""

from __future__ import annotations

from pathlib import Path

from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.common.model.loading import load_processor
from vlkv.deploy import synthetic_task
from vlkv.deploy.calibrate.prompts import write_prompts


def synthetic_prompts(out: Path, count: int, seed: int) -> Path:
    """``out/prompts.jsonl``: ``count`` synthetic-task training examples (``seed``) as calibration prompts."""
    processor = load_processor(str(DEFAULT_MODEL_DIR))
    examples = synthetic_task.make_examples(count, seed=seed, split="train")
    return write_prompts(out / "prompts.jsonl", processor, examples, synthetic_task)
