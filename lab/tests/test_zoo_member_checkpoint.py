"""Every lab path that loads a zoo member goes through ``Member.checkpoint()``, which assembles a real-decoder
member on first use: on a fresh machine ``vlkv eval zoo --members smol_codes`` (and ``calibrate_check``)
failed with "model path ... is not a directory" because ``run_member`` read ``model_dir`` directly."""

from __future__ import annotations

from pathlib import Path

import pytest
from vlkv_lab.zoo import member
from vlkv_lab.zoo.interface import Member


class Loaded(Exception):
    """Raised by the stand-in loader with the path it was handed."""


def fake_member(tmp_path: Path, calls: list) -> Member:
    built = tmp_path / "assembled"

    def assemble() -> Path:
        calls.append("assemble")
        built.mkdir(exist_ok=True)
        (built / "config.json").write_text("{}")  # what ModelConfig checks before the loader runs
        return built

    base = member("grid16")
    return Member(
        "fake_smol",
        tmp_path / "not-built-yet",
        base.max_new_tokens,
        base.geometry,
        base.make_examples,
        assemble=assemble,
    )


def refuse_load(config):
    raise Loaded(str(config.path))


def test_checkpoint_assembles_a_built_member_and_returns_a_shipped_one_as_is(tmp_path):
    calls: list = []
    fake = fake_member(tmp_path, calls)
    assert fake.checkpoint() == tmp_path / "assembled" and calls == ["assemble"]
    shipped = member("grid16")
    assert shipped.assemble is None and shipped.checkpoint() == shipped.model_dir


def test_zoo_run_member_loads_the_assembled_checkpoint(tmp_path, monkeypatch):
    import vlkv.common.model.loading as loading
    from vlkv_lab.eval import zoo

    calls: list = []
    monkeypatch.setattr(zoo, "member", lambda name: fake_member(tmp_path, calls))
    monkeypatch.setattr(loading, "load_model", refuse_load)
    with pytest.raises(Loaded) as got:
        zoo.run_member("fake_smol", 2, 0, "heldout", [], [0.1])
    assert got.value.args[0] == str(tmp_path / "assembled") and calls == ["assemble"]


def test_calibrate_check_loads_the_assembled_checkpoint(tmp_path, monkeypatch):
    import vlkv.common.model.loading as loading
    import vlkv_lab.zoo as zoo_pkg
    from vlkv_lab import calibrate_check

    calls: list = []
    monkeypatch.setattr(zoo_pkg, "member", lambda name: fake_member(tmp_path, calls))
    monkeypatch.setattr(loading, "load_model", refuse_load)
    with pytest.raises(Loaded) as got:
        calibrate_check._member("fake_smol", 2, 0, lambda b: [], [0.1])
    assert got.value.args[0] == str(tmp_path / "assembled") and calls == ["assemble"]
