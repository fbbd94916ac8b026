"""The summary `vlkv demo` prints: answers vs the full cache, bytes kept, sequences a pool holds."""

from types import SimpleNamespace

from vlkv.decode_worker.block_manager import blocks_needed
from vlkv.deploy.cli.demo_summary import DemoSummary
from vlkv.v1 import generate_pb2


def _out(text: str, kept: int, full: int, budgets: list[int], prompt: int):
    usage = generate_pb2.Usage(
        kv_bytes_kept=kept, kv_bytes_full=full, layer_budgets=budgets, prompt_tokens=prompt
    )
    return SimpleNamespace(text=text, finished=SimpleNamespace(usage=usage))


def test_summary_counts_agreement_bytes_and_capacity():
    s = DemoSummary("vlcache", 0.1)
    s.add(
        _out("the square red .", 100, 1000, [60, 70, 50, 60], 600),
        True,
        _out("the square red .", 1000, 1000, [600] * 4, 600),
        True,
    )
    s.add(
        _out("the circle blue .", 200, 2000, [120, 110, 130, 120], 1200),
        False,
        _out("the circle green .", 2000, 2000, [1200] * 4, 1200),
        True,
    )
    assert (s.n, s.correct, s.full_correct, s.agree) == (2, 1, 2, 1)
    comp, full = s.capacity(total_blocks=1000, block_size=16, max_new_tokens=12)
    want_comp = (
        1000 // blocks_needed([60, 70, 50, 60], 12, 16) + 1000 // blocks_needed([120, 110, 130, 120], 12, 16)
    ) / 2
    want_full = (1000 // blocks_needed([600] * 4, 12, 16) + 1000 // blocks_needed([1200] * 4, 12, 16)) / 2
    assert (comp, full) == (want_comp, want_full) and comp > 5 * full
    text = s.render((1000, 1), block_size=16, max_new_tokens=12)
    assert (
        "1/2 compressed" in text
        and "2/2 with the full cache" in text
        and "1/2 compressed answers identical" in text
    )
    assert "(10.0%)" in text  # 300 of 3000 bytes
    assert f"holds {want_comp:.0f} sequences" in text and f"vs {want_full:.0f} with the full cache" in text


def test_summary_without_pool_or_comparison():
    s = DemoSummary("full", None)
    s.add(_out("there are two .", 1000, 1000, [600] * 4, 600), True)
    text = s.render(None, block_size=16, max_new_tokens=12)
    assert "1/1 with the full cache" in text and "identical" not in text and "KV pool" not in text
    want = 32768 // blocks_needed([600] * 4, 12, 16)
    assert f"holds {want} sequences of this size with the full cache" in s.render((32768, 1), 16, 12)
