"""The counter-based hash every random draw of the library comes from, in PyTorch (int64 tensors holding uint32).

A draw is a pure function of (seed, position, purpose, index): its 32 random bits are MurmurHash3_x86_32 (hash seed
0) of the six 32-bit words (seed lo, seed hi, position lo, position hi, purpose, index). There is no generator state,
so the ops are graph-capturable and a request's draws do not depend on the rest of its batch. ops/sampling.py says
which purposes and indices each op uses; kernels/counter_hash.py is the same hash in Triton, with these constants.

A uniform is ``(bits >> 8) * 2**-24`` (exact in float32, in [0, 1)). An exponential is E = -log(1 - w) with
``w = float32(bits) * 2**-32 + 2**-33``; for w < 2**-7 E is the series w(1 + w(1/2 + w(1/3 + w/4))) instead, so
that small E (the likely winners of a race) keep 32-bit resolution; w = 1 gives E = inf.
"""
from __future__ import annotations

import torch

# Purposes: which stream a draw belongs to (hashed into every draw).
DRAFT, ACCEPT, RESIDUAL, BONUS = 1, 2, 3, 4

M32 = 0xFFFFFFFF
C1, C2, C3 = 0xCC9E2D51, 0x1B873593, 0xE6546B64  # MurmurHash3_x86_32's block mixing
F1, F2 = 0x85EBCA6B, 0xC2B2AE35  # its finalizer
KEY_BYTES = 24  # six 32-bit words
THIRD = 0.3333333432674408  # float32(1/3), written exactly so every backend uses the same constant
SERIES_BELOW = 0.0078125  # 2**-7: below it, the exponential's series
UNIFORM_SCALE = 5.960464477539063e-08  # 2**-24
EXP_SCALE = 2.3283064365386963e-10  # 2**-32
EXP_OFFSET = 1.1641532182693481e-10  # 2**-33


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for a in [0, 2**32), split in 16-bit halves of c so int64 never overflows."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & M32


def _rotl32(a: torch.Tensor, r: int) -> torch.Tensor:
    return ((a << r) | (a >> (32 - r))) & M32


def _mix_word(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    word = _mul32(_rotl32(_mul32(word, C1), 15), C2)
    return (_rotl32(h ^ word, 13) * 5 + C3) & M32


def random_bits(seed, position, purpose: int, index) -> torch.Tensor:
    """The 32 random bits (as int64) of draw (seed, position, purpose, index); broadcasts int64 tensors.

    seed, position, index: int64 tensors (or ints) of broadcastable shapes; purpose: one of DRAFT, ACCEPT, RESIDUAL,
    BONUS. Returns int64 of the broadcast shape, each entry in [0, 2**32).
    """
    seed = torch.as_tensor(seed, dtype=torch.int64)
    position = torch.as_tensor(position, dtype=torch.int64)
    index = torch.as_tensor(index, dtype=torch.int64)
    h = torch.zeros((), dtype=torch.int64, device=seed.device)
    for word in (seed & M32, (seed >> 32) & M32, position & M32, (position >> 32) & M32,
                 torch.full_like(h, purpose), index & M32):
        h = _mix_word(h, word)
    h = h ^ KEY_BYTES
    h = h ^ (h >> 16)
    h = _mul32(h, F1)
    h = h ^ (h >> 13)
    h = _mul32(h, F2)
    return h ^ (h >> 16)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniform in [0, 1) from int64 bits in [0, 2**32), same shape."""
    return (bits >> 8).to(torch.float32) * 2.0**-24


def exponential_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 standard exponential (> 0, possibly inf) from int64 bits in [0, 2**32), same shape."""
    w = bits.to(torch.float32) * 2.0**-32 + 2.0**-33
    series = w * (1.0 + w * (0.5 + w * (THIRD + w * 0.25)))
    return torch.where(w < SERIES_BELOW, series, -torch.log(1.0 - w))
