"""The float32 <-> bfloat16 casts of protos/halfcast.py against ``Tensor.to``, bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from protos import halfcast


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _float32(words: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(words, dtype=np.uint32).view(np.float32).copy())


def test_narrowing_rounds_as_torch_does_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-44, 38, 2000, dtype=torch.float64).to(torch.float32)
    random = torch.randn((2000, 37), generator=gen) * scales[:, None]
    special = _float32([
        0x3F808000, 0x3F818000,  # ties: the lowest kept bit 0 (stays), 1 (rounds up)
        0x3F807FFF, 0x3F808001,  # just below and above a tie
        0x7F7FFFFF, 0xFF7FFFFF,  # the largest finite values: round to infinity
        0x00000001, 0x80008000, 0x007FFFFF,  # subnormals
        0x7F800000, 0xFF800000, 0x80000000, 0x00000000,  # +-inf, -0, +0
    ])
    for x in (random, random[:, 5:20], random[::3], random[:0], special):
        got = halfcast.cast(x, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert torch.equal(_bits(got), _bits(x.to(torch.bfloat16)))


def test_narrowing_makes_every_nan_what_torch_makes_of_it() -> None:
    nans = _float32([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFF800001])
    got = halfcast.cast(nans, torch.bfloat16)
    assert torch.isnan(got.to(torch.float32)).all()
    assert torch.equal(_bits(got), _bits(nans.to(torch.bfloat16)))


def test_widening_equals_tensor_to_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn((300, 13), generator=gen) * 1e30).to(torch.bfloat16)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    for view in (x, x[:, 3:9], x[::2], x[:0]):  # contiguous or not, empty
        got = halfcast.cast(view, torch.float32)
        assert got.dtype == torch.float32 and got.shape == view.shape
        assert torch.equal(_bits(got), _bits(view.to(torch.float32)))


def test_other_casts_are_tensor_to_and_a_same_dtype_cast_is_no_copy() -> None:
    x = torch.randn(50, 3)
    half = x.to(torch.float16)
    assert torch.equal(_bits(halfcast.cast(half, torch.float32)), _bits(half.to(torch.float32)))
    assert torch.equal(_bits(halfcast.cast(x, torch.float16)), _bits(half))
    assert halfcast.cast(x, torch.float32) is x


def test_single_of_half_is_exact_for_every_float16() -> None:
    from protos.halfcast import single_of_half

    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.array([single_of_half(w) for w in words], dtype=np.uint32)
    want = words.view(np.float16).astype(np.float32).view(np.uint32)
    finite = ~np.isnan(words.view(np.float16))
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(got[~finite].view(np.float32)).all()
