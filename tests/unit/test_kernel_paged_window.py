"""Paged decode attention of a sliding-window layer (``window``): only each sequence's last ``W`` tokens.

The reference against SDPA on the last ``W`` gathered tokens, and the Triton kernels (through the interpreter
on CPU, as in ``test_kernel_paged_decode.py``) against the reference, attention mass included: windows
shorter and longer than a sequence, not multiples of the block or of the tile, splits wholly before a window.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from paged_decode_cases import DEVICE, make_case  # noqa: E402
from triton_interpret import INTERPRET, kernel_module  # noqa: E402
from vlkv.kernels.paged_decode_reference import paged_decode_reference  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)

LENGTHS = [1, 4, 5, 17, 9, 40, 70]


@pytest.fixture(scope="module")
def kernels():
    yield from kernel_module("vlkv.kernels.paged_decode", "_split_kernel")


def windowed_dense(q, k_pool, v_pool, table, lengths, scale, window):
    """SDPA (GQA) over each sequence's last ``window`` tokens, gathered one by one."""
    page, outs = k_pool.shape[2], []
    for s in range(q.shape[0]):
        n = int(lengths[s])
        t = torch.arange(max(0, n - window), n)
        blocks = table[s, t // page].long()
        k = k_pool[blocks, :, t % page].transpose(0, 1).float()  # [H_kv, n', D]
        v = v_pool[blocks, :, t % page].transpose(0, 1).float()
        outs.append(
            F.scaled_dot_product_attention(q[s].float()[:, None], k, v, scale=scale, enable_gqa=True)[:, 0]
        )
    return torch.stack(outs)


@pytest.mark.parametrize("window", [1, 3, 8, 13, 64, 1000])
def test_reference_masks_to_the_window(window):
    q, k_pool, v_pool, table, lengths = make_case(LENGTHS, 8, 2, 16, 4, 128, torch.float32)
    got = paged_decode_reference(q, k_pool, v_pool, table, lengths, scale=0.3, window=window)
    want = windowed_dense(q, k_pool, v_pool, table, lengths, 0.3, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mass = torch.zeros(len(LENGTHS), table.shape[1] * 4)
    paged_decode_reference(q, k_pool, v_pool, table, lengths, scale=0.3, window=window, mass_out=mass)
    for s, n in enumerate(LENGTHS):  # probabilities of the window only, summing to the 8 heads
        assert float(mass[s, : max(0, n - window)].abs().sum()) == 0.0
        assert float(mass[s].sum()) == pytest.approx(8.0, rel=1e-5)


@pytest.mark.parametrize("window", [3, 13, 64])
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_matches_reference_with_a_window(kernels, window, splits):
    q, k_pool, v_pool, table, lengths = make_case(LENGTHS, 8, 2, 16, 4, 128, torch.float32, seed=1)
    args = [t.to(DEVICE) for t in (q, k_pool, v_pool, table, lengths)]
    want = paged_decode_reference(*args, scale=0.3, window=window)
    mass = torch.zeros(len(LENGTHS), table.shape[1] * 4, device=DEVICE)
    got = kernels.paged_decode_attention(
        *args, scale=0.3, window=window, force_triton=True, num_splits=splits, block_n=16, mass_out=mass
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    want_mass = torch.zeros_like(mass)
    paged_decode_reference(*args, scale=0.3, window=window, mass_out=want_mass)
    torch.testing.assert_close(mass, want_mass, rtol=1e-4, atol=1e-5)
