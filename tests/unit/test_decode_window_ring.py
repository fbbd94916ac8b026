"""Sliding-window layers are rings in the decode pool (``BlockManager.slide``, ``block_math.ring_blocks``).

The decode attention reads a sliding layer's last ``W`` entries only, so once the layer's cache outgrows its
window the blocks wholly before it go back (``grow``) or to the end of the layer's own table (``reserve``), and
admission counts the layer's growth as capped by its ring. Checked: the arithmetic against a simulation of
the pool (which entries every step reads, block by block), admission's counts, and on tiny Gemma 3 (two layers
with window 8, one global) and Mistral (window 8 everywhere) a generation six times the window: the greedy
tokens equal ``model.generate()`` in process (grow, reserve, and under preemption) and through gRPC, a sliding
layer's blocks stay at its ring while the global layer's grow, and every block returns at the end.
"""

from __future__ import annotations

import io

import pytest
import torch
from inproc_cluster import InProcCluster
from PIL import Image
from sample_images import random_png
from vlkv.common.block_math import blocks_needed, ceil_div, dead_blocks, layer_blocks, ring_blocks
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig, TransferConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import AdmissionPolicy, AdmissionRefusal, BlockManager, RefusalKind
from vlkv.decode_worker.kv_cache import block_bytes_of
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.inprocess import InProcessEngine

QUESTION = "what colour is the square ?"
WINDOW, BLOCK = 8, 4  # the variants' window; small blocks so the ring turns many times
MAX_NEW = 48  # six windows
RING = ring_blocks(WINDOW, BLOCK)  # 3


# -- the arithmetic -----------------------------------------------------------------------------------------
def _simulate(window: int, block: int, n: int, steps: int, reserve: bool) -> int:
    """Decode ``steps`` tokens on layer 0 (window ``window``) of a sequence of ``n`` entries through a block
    manager, checking at every step that the entries the attention reads (the last ``W`` of the table and
    length it is given) are exactly the positions the model reads, ``p - W + 1 .. p``; returns the most
    blocks the layer held."""
    policy = AdmissionPolicy(reserve=reserve)
    pool = BlockManager(200, block, policy, windows=(window, 0))
    lengths = [n, n]
    got = pool.admit(lengths, steps, 0)
    assert not isinstance(got, AdmissionRefusal)
    blocks, free_at_admission = got, pool.num_free
    where: dict[tuple[int, int], int] = {}  # (block id, offset) -> the position written there (layer 0)
    for t in range(n):
        where[blocks.tables[0][t // block], t % block] = t
    peak = len(blocks.tables[0])
    for p in range(n, n + steps):  # position p's token is appended at index lengths[0]
        if reserve:
            assert pool.blocks_to_append(blocks, lengths) == 0, "a reserved ring needs no block"
        assert pool.append(blocks, lengths)
        table, live = blocks.tables[0], lengths[0]
        peak = max(peak, len(table))
        where[table[live // block], live % block] = p
        reach = range(max(0, live + 1 - window), live + 1)
        assert [where[table[i // block], i % block] for i in reach] == list(
            range(max(0, p + 1 - window), p + 1)
        )
        lengths = [live + 1, lengths[1] + 1]
        dropped = pool.slide(blocks, lengths)
        assert dropped == (live + 1 - lengths[0]) and dropped % block == 0
        assert lengths[1] == p + 1, "a layer without a window keeps every entry"
        if reserve:
            assert pool.num_free == free_at_admission
    assert len(blocks.tables[1]) == ceil_div(n + steps, block)
    pool.free(blocks)
    assert pool.num_free == pool.num_blocks
    return peak


@pytest.mark.parametrize("reserve", [False, True], ids=["grow", "reserve"])
def test_a_sliding_layer_holds_at_most_its_ring_and_reads_its_window(reserve):
    for block in (1, 3, 4, 16):
        for window in (2, 5, 8, 17):
            for n in (1, window - 1, window + 2 * block + 1):
                for steps in (1, 7, 40):
                    peak = _simulate(window, block, n, steps, reserve)
                    bound = layer_blocks(n, steps, block, window)
                    assert peak <= bound, (block, window, n, steps)
                    if n <= window - 1:  # what a prefill hands over: the bound is exact
                        assert peak == bound, (block, window, n, steps)
                    if n <= window - 1 and steps >= window + block:
                        assert bound == ring_blocks(window, block)


def test_dead_blocks_are_the_ones_before_the_next_steps_window():
    assert dead_blocks(100, 0, 4) == 0  # no window: nothing
    assert dead_blocks(10, 8, 4) == 0  # the next step reads entries 3..10: block 0 (0..3) still
    assert dead_blocks(11, 8, 4) == 1  # it reads 4..11
    assert dead_blocks(7, 8, 1) == 0 and dead_blocks(8, 8, 1) == 1
    assert ring_blocks(8, 4) == 3 and ring_blocks(9, 4) == 3 and ring_blocks(10, 4) == 4
    assert ring_blocks(8, 16) == 2 and ring_blocks(2, 1) == 2


def test_admission_counts_a_sliding_layer_as_its_ring():
    lengths, new = [7, 7, 27], 100
    full = blocks_needed(lengths, new, BLOCK)
    ring = blocks_needed(lengths, new, BLOCK, (WINDOW, WINDOW, 0))
    assert full == 2 * ceil_div(107, 4) + ceil_div(127, 4) == 86
    assert ring == 2 * RING + ceil_div(127, 4) == 38
    # a window the request cannot outgrow changes nothing; nor does the admission of grow (no extra tokens)
    assert blocks_needed([20, 20], 30, BLOCK, (64, 0)) == blocks_needed([20, 20], 30, BLOCK)
    assert blocks_needed(lengths, 0, BLOCK, (WINDOW, WINDOW, 0)) == blocks_needed(lengths, 0, BLOCK)
    with pytest.raises(ValueError, match="2 sliding windows for 3 layers"):
        blocks_needed(lengths, new, BLOCK, (WINDOW, 0))

    reserve = BlockManager(40, BLOCK, AdmissionPolicy(reserve=True), windows=(WINDOW, WINDOW, 0))
    assert BlockManager(40, BLOCK).refusal(lengths, new).kind is RefusalKind.NEVER_FITS
    assert reserve.refusal(lengths, new) is None and reserve.admit_need(lengths, new) == 38
    got = reserve.admit(lengths, new)
    assert [len(t) for t in got.tables] == [RING, RING, 32] and reserve.num_free == 2
    assert reserve.refusal([7, 7, 27], 100).kind is RefusalKind.POOL_FULL
    reserve.free(got)
    grow = BlockManager(40, BLOCK, windows=(WINDOW, WINDOW, 0))
    assert grow.admit_need(lengths, new) == 2 + 2 + 7  # grow takes the cache's own blocks
    assert grow.refusal(lengths, 1000) is not None and grow.refusal(lengths, 100) is None
    # a resumed sequence takes its held entries and its next token's slot, as before
    assert grow.blocks_needed([10, 10, 74], 1) == 3 + 3 + 19


def test_windows_must_fit_the_layers():
    pool = BlockManager(10, BLOCK, windows=(WINDOW, 0))
    with pytest.raises(ValueError, match="3 layers"):
        pool.allocate([1, 1, 1], 0)
    with pytest.raises(ValueError, match="0 or >= 2"):
        BlockManager(10, BLOCK, windows=(1, 0))
    assert BlockManager(10, BLOCK, windows=(0, 0)).windows == ()


# -- a real model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llava-gemma3", "llava-mistral-w8"])
def tiny(request, tiny_model_dirs):
    path = tiny_model_dirs(request.param)
    model, proc = load_model(ModelConfig(path=path)), load_processor(path)
    return request.param, model, proc


def _reference(model, proc, image: bytes, max_new: int = MAX_NEW) -> list[int]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(images=[Image.open(io.BytesIO(image)).convert("RGB")], text=text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = proc.tokenizer.eos_token_id
    return ids[: ids.index(eos)] if eos in ids else ids


def _watch(engine: InProcessEngine) -> list[tuple[list[list[int]], int]]:
    """Record, at every step, each stepped sequence's per-layer table sizes and the pool's free blocks."""
    seen: list[tuple[list[list[int]], int]] = []
    forward = engine.core.forward

    def watched(batch):
        seen.append(([[len(t) for t in s.blocks.tables] for s in batch], engine.blocks.num_free))
        return forward(batch)

    engine.core.forward = watched
    return seen


def _generate(engine: InProcessEngine, images: list[bytes]):
    sampling = SamplingConfig(max_new_tokens=MAX_NEW)
    full = CompressionSettings("full")
    reqs = [
        engine.prepare([img], question=QUESTION, sampling=sampling, compression=full, request_id=f"r{i}")
        for i, img in enumerate(images)
    ]
    return engine.generate_batch(reqs)


@pytest.mark.parametrize("admission", ["grow", "reserve"])
def test_long_generation_on_a_ring_equals_generate(tiny, admission):
    variant, model, proc = tiny
    engine = InProcessEngine(model, proc, pool_bytes=4 << 20, block_size=BLOCK, admission=admission)
    windows = engine.blocks.windows
    assert windows and set(windows) <= {0, WINDOW}, variant
    seen = _watch(engine)
    image = random_png(11)
    (got,) = _generate(engine, [image])
    assert got.generated_tokens == MAX_NEW and got.finish_reason == "length"
    assert got.token_ids == _reference(model, proc, image), (variant, admission)
    m = got.prompt_tokens
    assert m > 3 * WINDOW
    sizes = [per_seq[0] for per_seq, _ in seen]
    for layer, w in enumerate(windows):
        held = [s[layer] for s in sizes]
        if w:  # the ring: its blocks stay bounded however long the generation
            assert max(held) == RING and held[-1] <= RING, (variant, layer, held)
        else:  # a global layer grows with every token
            assert held[-1] == ceil_div(m + MAX_NEW - 1, BLOCK) or admission == "reserve"
            assert held[-1] >= ceil_div(m + MAX_NEW - 1, BLOCK)
    if admission == "reserve":  # reserved at admission, and no step takes or frees a block
        assert len({free for _, free in seen}) == 1
    assert engine.core.slid_tokens > 0 and engine.core.slid_tokens % BLOCK == 0
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every block came back


def test_preempted_rings_resume_with_the_same_tokens(tiny):
    """A pool too small for three long generations: the newest is swapped out (its rings' held entries
    only) and back; every sequence's tokens still equal ``generate()``."""
    variant, model, proc = tiny
    _, kv_heads, head_dim, dtype = ModelSpec.from_model(model, proc.tokenizer).kv_layout
    # Gemma 3: 11 blocks a cache at admission, 25 at the end (3 + 3 + 19); Mistral: 6, then 9
    pool_blocks = 48 if variant == "llava-gemma3" else 20
    pool_bytes = pool_blocks * block_bytes_of(BLOCK, kv_heads, head_dim, dtype)
    images = [random_png(20 + i) for i in range(3)]
    want = [_reference(model, proc, img) for img in images]
    assert min(map(len, want)) > 3 * WINDOW, "generations that outgrow the window"
    engine = InProcessEngine(model, proc, pool_bytes=pool_bytes, block_size=BLOCK, watermark=0.0)
    assert engine.blocks.num_blocks == pool_blocks
    got = _generate(engine, images)
    assert engine.core.scheduler.preemptions > 0, variant
    assert [g.token_ids for g in got] == want, variant
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_ring_through_grpc_equals_generate(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gemma3")),
        pool=PoolConfig(pool_bytes=4 << 20, block_size=BLOCK),
        transfer=TransferConfig(kv_transport="grpc"),
    )
    cluster = InProcCluster(cfg)
    try:
        free_before = cluster.pool.num_free
        assert cluster.pool.windows == (WINDOW, WINDOW, 0)
        image = random_png(13)  # no EOS within MAX_NEW
        req = build_request(images=[image], question=QUESTION, max_new_tokens=MAX_NEW, policy="full")
        got = generate(cluster.stub, req, timeout=120)
        assert got.finished.usage.generated_tokens == MAX_NEW
        assert got.token_ids == _reference(cluster.model, cluster.processor, image)
        assert cluster.pool.num_free == free_before
        assert cluster.decode.servicer.engine.core.slid_tokens > 0  # the rings turned
    finally:
        cluster.close()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_an_8bit_ring_keeps_its_layers_scales(tiny_model_dirs, kv_dtype):
    """In an 8-bit pool every block of a layer carries the layer's K scales (the kernels read them from its
    first block, a new block takes them from there): with the leading blocks gone, every block a ring holds
    still carries the scales its layer arrived with."""
    path = tiny_model_dirs("llava-gemma3")
    model, proc = load_model(ModelConfig(path=path)), load_processor(path)
    engine = InProcessEngine(model, proc, pool_bytes=4 << 20, block_size=BLOCK, kv_dtype=kv_dtype)
    arrived: dict[tuple[int, int], torch.Tensor] = {}  # (sequence, layer) -> its K scales
    sizes: list[int] = []
    postprocess = engine.core.postprocess

    def checked(batch, logits):  # after the step wrote its token, before the rings turn
        for seq in batch:
            for layer, table in enumerate(seq.blocks.tables):
                held = engine.cache.k_scale[torch.tensor(table)]
                want = arrived.setdefault((id(seq), layer), held[0].clone())
                assert torch.equal(held, want.expand_as(held)), (kv_dtype, layer)
            sizes.append(len(seq.blocks.tables[0]))
        return postprocess(batch, logits)

    engine.core.postprocess = checked
    got = _generate(engine, [random_png(13), random_png(15)])
    assert min(g.generated_tokens for g in got) > 3 * WINDOW
    assert max(sizes) == RING and engine.core.slid_tokens > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def _kernel_case(quantized: bool):
    """One sequence of 14 entries in blocks 3, 5, 6, 7 (block size 4) of an 8-block pool, window 5: blocks 3
    and 5 lie wholly before the window of the step (entries 9..13). Pool block 0 is someone else's, with
    other K scales."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.int8 if quantized else torch.float32
    shape = (8, 2, BLOCK, 16)
    if quantized:
        k = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        v = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    else:
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    scales = ()
    if quantized:
        k_scale = (
            torch.rand(2, 16, generator=g).half().expand(8, 2, 16).clone()
        )  # one layer's, in every block
        k_scale[0] = torch.rand(2, 16, generator=g).half() * 9  # block 0: another layer's
        scales = (k_scale, torch.rand(8, 2, BLOCK, generator=g).half())
    q = torch.randn(1, 4, 16, generator=g)
    return q, k.to(dtype), v.to(dtype), scales


@pytest.mark.parametrize(
    "quantized",
    [
        False,
        True,
    ],
    ids=["fp32", "int8"],
)
def test_dropping_the_blocks_before_the_window_leaves_the_attention_as_it_was(quantized):
    from vlkv.kernels.paged_decode_reference import paged_decode_reference

    q, k, v, scales = _kernel_case(quantized)
    kw = dict(scale=0.25, window=5)
    if scales:
        kw.update(k_scale=scales[0], v_scale=scales[1])
    whole = paged_decode_reference(
        q, k, v, torch.tensor([[3, 5, 6, 7]], dtype=torch.int32), torch.tensor([14], dtype=torch.int32), **kw
    )
    ring = paged_decode_reference(
        q, k, v, torch.tensor([[6, 7]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32), **kw
    )
    torch.testing.assert_close(ring, whole, rtol=1e-5, atol=1e-5)
