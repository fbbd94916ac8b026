"""deploy/progress.py: plain periodic lines off a terminal, a tqdm bar on one, nothing when disabled."""

from __future__ import annotations

import io

import pytest
from vlkv.deploy import progress as progress_mod
from vlkv.deploy.progress import Progress, format_seconds, interval_from_env, progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """Stands in for progress.monotonic: each tick advances by ``step`` seconds."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_plain_lines_have_counts_eta_and_a_final_line(monkeypatch) -> None:
    monkeypatch.setattr(progress_mod, "monotonic", Clock(step=1.0))
    out = io.StringIO()
    assert list(progress(range(40), desc="eval", unit="example", stream=out, interval=10)) == list(range(40))
    lines = out.getvalue().splitlines()
    periodic, final = lines[:-1], lines[-1]
    assert 2 <= len(periodic) <= 40 // 5  # at most one line per 10 s of (fake) time
    assert periodic[0].startswith("eval: ") and "/40 (" in periodic[0]
    assert all(" elapsed " in ln and " eta " in ln for ln in periodic)
    assert final.startswith("eval: 40/40 (100%) done in ")
    assert "\r" not in out.getvalue()


def test_manual_progress_with_postfix_and_unknown_total() -> None:
    out = io.StringIO()
    with Progress(desc="loadgen", unit="req", stream=out, interval=0) as bar:
        bar.set_postfix("2 in flight, 0 errors")
        bar.update(3)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("loadgen: 3 req elapsed ") and lines[0].endswith("| 2 in flight, 0 errors")
    assert lines[-1].startswith("loadgen: 3 req done in ")
    bar.close()  # closing twice prints nothing more
    assert out.getvalue().splitlines() == lines


def test_tty_gets_a_tqdm_bar_with_eta() -> None:
    out = FakeTTY()
    for _ in progress(range(5), desc="train", unit="step", stream=out):
        pass
    text = out.getvalue()
    assert "train" in text and "5/5" in text and "step/s" in text and "<" in text  # tqdm: [elapsed<eta]


def test_disabled_prints_nothing() -> None:
    for out in (io.StringIO(), FakeTTY()):
        assert sum(progress(range(5), desc="x", stream=out, disable=True, interval=0)) == 10
        with Progress(3, stream=out, disable=True, interval=0) as bar:
            bar.update(3)
        assert out.getvalue() == ""


def test_interval_from_env(monkeypatch) -> None:
    monkeypatch.delenv("VLKV_PROGRESS_INTERVAL", raising=False)
    assert interval_from_env() == 10.0
    monkeypatch.setenv("VLKV_PROGRESS_INTERVAL", "2.5")
    assert interval_from_env() == 2.5
    assert Progress(stream=io.StringIO()).interval == 2.5
    monkeypatch.setenv("VLKV_PROGRESS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="VLKV_PROGRESS_INTERVAL"):
        interval_from_env()


def test_format_seconds() -> None:
    assert [format_seconds(s) for s in (0, 59.9, 61, 3725)] == ["0s", "59s", "1m01s", "1h02m"]
