"""``vlkv calibrate-reuse``: per-layer sensitivities measured on a model, stored as JSON beside it, and used
by the prefill worker's schedule (only for the model it was measured on)."""

from __future__ import annotations

import json
import shutil

from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.calibrate import reuse as calibrate_reuse
from vlkv.deploy.cli.main import main
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv.prefill_worker.image_reuse import ImageReuser
from vlkv.prefill_worker.reuse_schedule import CALIBRATION_FILE, greedy_ratios, layer_ratios


def test_calibration_is_measured_stored_as_json_and_used(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(ModelConfig().path, model_dir)
    assert main(["calibrate-reuse", "--model", str(model_dir), "-n", "2"]) == 0
    data = json.loads((model_dir / CALIBRATION_FILE).read_text())  # JSON, never pickle
    sens = data["sensitivity"]
    assert data["examples"] == 2 and len(sens) == 4 and all(len(row) == 11 for row in sens)
    # layer 0's K/V of image tokens depend only on the image and the position: reuse costs nothing there
    assert max(sens[0]) - min(sens[0]) < 1e-3 * max(sens[0])
    # deeper layers: holding the correct K/V for all of the image in one layer changes the error, and in at
    # least one layer it removes a clear share of it (errors do not add up layer by layer: fixing one layer
    # while the others stay stale can also leave it where it was)
    assert all(row[10] != row[0] for row in sens[1:])
    assert min(row[10] / row[0] for row in sens[1:]) < 0.9
    model = load_model(ModelConfig(path=str(model_dir)))
    eng = InProcessEngine(model, load_processor(str(model_dir)))
    reuser = ImageReuser(model, eng.spec, ImageCache(1 << 20))
    assert reuser.calibration is not None and reuser.calibration.sensitivity == sens
    assert layer_ratios("layerwise", 0.1, 4, reuser.calibration) == greedy_ratios(sens, 4)
    other = calibrate_reuse.Calibration("another-model", sens)
    (model_dir / CALIBRATION_FILE).write_text(other.to_json())
    assert ImageReuser(model, eng.spec, ImageCache(1 << 20)).calibration is None  # foreign: default schedule
