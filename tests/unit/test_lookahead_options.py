"""Draft-query (lookahead) options without a model: bad values are refused clearly, the base scores are needed,
the options round-trip through the proto, a policy's dict and the HTTP front's extra body, and the mixed scores
are each source's mean attention per row. (On a served model: tests/integration/test_lookahead.py.)"""

from __future__ import annotations

import pytest
import torch
from vlkv.common.compression.lookahead import DraftStats, mixed_col_sum
from vlkv.common.compression.registry import CompressionSettings, get_policy
from vlkv.common.errors import InvalidInput
from vlkv.common.request import compression_from_proto, compression_to_proto
from vlkv.v1 import generate_pb2


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"lookahead": -1}, "lookahead must be >= 0"),
        ({"lookahead": 65}, "lookahead must be at most 64"),
        ({"lookahead_weight": -0.1}, "lookahead_weight must be in [0, 1]"),
        ({"lookahead_weight": 1.5}, "lookahead_weight must be in [0, 1]"),
    ],
)
def test_bad_options_are_refused_clearly(params, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        get_policy("vlcache", **params)
    with pytest.raises(ValueError, match="lookahead"):
        CompressionSettings("vlcache", 0.1, **params)


def test_lookahead_needs_the_base_scores():
    with pytest.raises(ValueError, match="streamingllm scores tokens its own way"):
        get_policy("streamingllm", lookahead=4)
    get_policy("snapkv", lookahead=4)  # the base score, pooled


def test_proto_round_trip_and_bad_values():
    settings = CompressionSettings("vlcache", 0.05, lookahead=16, lookahead_weight=0.25)
    back = compression_from_proto(compression_to_proto(settings))
    assert (back.lookahead, back.lookahead_weight) == (16, 0.25)
    assert back.build_policy().lookahead == 16
    unset = compression_from_proto(generate_pb2.CompressionParams(policy="vlcache"))
    assert unset.lookahead is None and unset.build_policy().lookahead == get_policy("vlcache").lookahead
    with pytest.raises(InvalidInput, match="lookahead must be at most 64"):
        compression_from_proto(generate_pb2.CompressionParams(lookahead=1000))
    with pytest.raises(InvalidInput, match="lookahead_weight"):
        compression_from_proto(generate_pb2.CompressionParams(lookahead=4, lookahead_weight=2.0))


def test_policy_dict_round_trip():
    from vlkv.common.compression.registry import policy_from_dict

    policy = get_policy("vlcache", lookahead=8, lookahead_weight=1.0)
    data = policy.image.to_dict()  # image prompts' policy; text-only prompts go to the default text preset
    assert data["lookahead"] == 8 and data["lookahead_weight"] == 1.0
    assert policy_from_dict(policy.to_dict()) == policy and policy_from_dict(data) == policy.image


def test_mixed_scores_are_each_sources_mean_attention_per_row():
    m, heads = 6, 2
    base = _Stats(torch.tensor([[3.0, 1.0, 0.0, 0.0, 0.0, 0.0]] * heads), tq=4)
    draft = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 0.0]] * heads)
    stats = DraftStats(base, draft, 2)
    mixed = mixed_col_sum(stats, m, 0.5, row_normalized=False)
    assert torch.allclose(mixed[0], torch.tensor([0.375, 0.125, 0.0, 0.5, 0.0, 0.0]))
    assert torch.equal(mixed_col_sum(stats, m, 1.0, row_normalized=False)[0], draft[0] / 2)
    assert mixed_col_sum(base, m, 0.5, row_normalized=False) is None  # no draft rows: score as before
    assert stats.row_max is base.row_max and stats.col_sum is base.col_sum  # the allocator's view


class _Stats:
    def __init__(self, col_sum: torch.Tensor, tq: int) -> None:
        heads = col_sum.shape[0]
        self.col_sum = col_sum
        self.row_max = torch.zeros(heads, tq)
        self.row_sumexp = torch.ones(heads, tq)
        self.below = torch.zeros(heads, dtype=torch.int64)
        self.unmasked = torch.ones(heads, dtype=torch.int64)


def test_http_extra_body_carries_lookahead():
    from vlkv.services.openai_schema import VlkvOptions, _compression

    pb = _compression(VlkvOptions(policy="vlcache", lookahead=8, lookahead_weight=1.0))
    assert pb.HasField("lookahead") and (pb.lookahead, pb.lookahead_weight) == (8, 1.0)
    assert not _compression(VlkvOptions()).HasField("lookahead")
    with pytest.raises(ValueError):
        VlkvOptions(lookahead=-1)
