"""``vlkv eval api``: a calibrated profile served through the public gRPC API gives the in-process
evaluation's answers for the profile's settings, and another model's profile is refused; ``--member`` checks
a text task on SmolLM2 and a real-decoder zoo member the same way, and a served answer unlike the in-process
table's is counted."""

from __future__ import annotations

import pytest
from vlkv.common.compression.profile import CompressionProfile, ProfileEntry, read_profile
from vlkv.common.compression.registry import policy_from_dict
from vlkv.common.config import DEFAULT_MODEL_DIR, ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.deploy.cli.main import main
from vlkv_lab.eval import api_check

# entries unlike the default, one (streamingllm at 1%: no image token kept) answering unlike it: the check
# must see that the profile, not the default, answered
ENTRIES = (
    (0.01, "streamingllm", {"policy": "streamingllm"}),
    (0.1, "allocator: uniform", {"policy": "vlcache", "allocator": {"name": "uniform"}}),
)


def _profile(path, fingerprint: str):
    entries = [ProfileEntry(b, label, policy_from_dict(d)) for b, label, d in ENTRIES]
    profile = CompressionProfile(
        model={"fingerprint": fingerprint, "path": str(DEFAULT_MODEL_DIR), "dtype": "float32"},
        prompts={"digest": "0" * 64, "count": 0},
        measure={"tokens": 4},
        entries=entries,
    )
    profile.write(path)
    return path


def test_a_calibrated_profile_answers_as_the_in_process_table_through_the_api(tmp_path):
    model_dir = str(DEFAULT_MODEL_DIR)
    spec = ModelSpec.from_model(load_model(ModelConfig(path=model_dir)), load_processor(model_dir).tokenizer)
    path = _profile(tmp_path / "profile.json", spec.fingerprint)
    out = tmp_path / "out"
    argv = ["eval", "api", "-n", "3", "--budgets", "0.01,0.1", "--concurrency", "2", "--out", str(out)]
    assert main([*argv, "--compression-profile", str(path)]) == 0  # 0 answers differ, usage names it
    md = (out / "api_check_profile.md").read_text()
    label = read_profile(path).label
    assert label in md and "profile 1% (streamingllm)" in md and "profile 10% (allocator: uniform)" in md
    rows = [line for line in md.splitlines() if line.startswith("| profile")]
    assert len(rows) == 2 and all("| 0/3 | 0/3 |" in line for line in rows)

    other = _profile(tmp_path / "other.json", "0" * 16)  # another model's fingerprint
    assert main([*argv, "--compression-profile", str(other)]) == 2  # refused at start-up


def _rows(md: str) -> list[str]:
    return [
        line for line in md.splitlines() if line.startswith("| ") and not line.startswith(("| run", "| ---"))
    ]


@pytest.mark.parametrize(
    "name, file, flags",  # float32 throughout: a bfloat16 prefill is ~46x slower on a CPU without AVX-512 BF16
    [
        (
            "text:niah_single_1",
            "text_niah_single_1",
            ["--concurrency", "2", "--batch-invariant", "--dtype", "float32"],
        ),
        ("text:niah_single_1", "text_niah_single_1", ["--concurrency", "2", "--dtype", "float32"]),
        ("smol_objects", "smol_objects", ["--concurrency", "2"]),
    ],
)
def test_a_member_is_asked_through_the_api_and_its_answers_compared(tmp_path, name, file, flags):
    argv = ["eval", "api", "--member", name, "-n", "2", "--budgets", "0.05", *flags]
    assert main([*argv, "--out", str(tmp_path)]) == 0  # 0 answers differ
    md = (tmp_path / f"api_check_{file}.md").read_text()
    dtype = (
        flags[flags.index("--dtype") + 1] if "--dtype" in flags else "bfloat16" if ":" in name else "float32"
    )
    assert md.splitlines()[0].endswith(f", {dtype})")  # both sides ran in it
    assert ("--batch-invariant`" in md) == ("--batch-invariant" in flags)
    rows = _rows(md)
    assert [r.split(" | ")[0] for r in rows] == ["| full", "| vlcache 5%"]
    assert all(r.endswith("| 0/2 | 0/2 |") for r in rows)


def test_an_answer_unlike_the_in_process_tables_is_counted(tmp_path, monkeypatch):
    runs = api_check._runs

    def other_in_process(
        args, profile
    ):  # the request names vlcache, the in-process side keeps the recent tokens
        return [(a, b, c, "streamingllm" if c else d, e) for a, b, c, d, e in runs(args, profile)]

    monkeypatch.setattr(api_check, "_runs", other_in_process)
    argv = [
        "eval",
        "api",
        "--member",
        "text:niah_single_1",
        "-n",
        "2",
        "--budgets",
        "0.05",
        "--concurrency",
        "2",
        "--dtype",
        "float32",  # a bfloat16 prefill is ~46x slower on a CPU without native bfloat16 (AVX-512 BF16, AMX)
    ]
    assert main([*argv, "--out", str(tmp_path)]) == 1
    full, compressed = _rows((tmp_path / "api_check_text_niah_single_1.md").read_text())
    assert full.endswith("| 0/2 | 0/2 |")
    differ = int(compressed.split(" | ")[-2].split("/")[0])
    assert differ >= 1 and compressed.startswith("| vlcache 5% | 1.000 (2/2")  # served right, in-process not


def test_verified_requests_through_the_api_match_the_in_process_verifier(tmp_path):
    """`--api-verify floor`: the served verifier keeps the in-process verifier's candidate and answers alike,
    every usage carries the verifier's fields (exit 0 only then)."""
    out = tmp_path / "out"
    argv = ["eval", "api", "--api-verify", "floor", "-n", "3", "--budgets", "0.02", "--concurrency", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    md = (out / "api_check_verify_floor.md").read_text()
    [row] = [line for line in md.splitlines() if line.startswith("| 2% |")]
    assert "| 0/3 | 0/3 |" in row
    with pytest.raises(SystemExit) as refused:  # an api flag given to the zoo is refused
        main(["eval", "zoo", "--api-verify", "floor"])
    assert refused.value.code == 2
