"""``vlkv eval --api --compression-profile``: a calibrated profile served through the public gRPC API gives
the in-process evaluation's answers for the profile's settings, and another model's profile is refused."""

from __future__ import annotations

from vlkv.common.compression.profile import CompressionProfile, ProfileEntry, read_profile
from vlkv.common.compression.registry import policy_from_dict
from vlkv.common.config import DEFAULT_MODEL_DIR, ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.tools.cli import main

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
    argv = ["eval", "--api", "-n", "3", "--budgets", "0.01,0.1", "--concurrency", "2", "--out", str(out)]
    assert main([*argv, "--compression-profile", str(path)]) == 0  # 0 answers differ, usage names it
    md = (out / "api_check_profile.md").read_text()
    label = read_profile(path).label
    assert label in md and "profile 1% (streamingllm)" in md and "profile 10% (allocator: uniform)" in md
    rows = [line for line in md.splitlines() if line.startswith("| profile")]
    assert len(rows) == 2 and all(line.endswith("| 0/3 | 0/3 |") for line in rows)

    other = _profile(tmp_path / "other.json", "0" * 16)  # another model's fingerprint
    assert main([*argv, "--compression-profile", str(other)]) == 2  # refused at start-up
