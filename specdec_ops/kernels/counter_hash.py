"""The counter-based hash (ops/counter_hash.py) in Triton: MurmurHash3_x86_32 of (seed, position, purpose, index).

A program hashes the first five words once per row (`row_state_tl`), then each draw hashes only its index
(`draw_bits_tl`). uint32 arithmetic wraps as the hash needs.
"""
import triton
import triton.language as tl

from .constants import C1, C2, C3, EXP_OFFSET, EXP_SCALE, F1, F2, KEY_BYTES, LN2, SERIES_BELOW, THIRD, UNIFORM_SCALE


@triton.jit
def _mix_word_tl(h, word):
    """One 32-bit block of the hash: h, word uint32 tensors of one shape."""
    word = word * C1
    word = (word << 15) | (word >> 17)
    word = word * C2
    h = h ^ word
    h = (h << 13) | (h >> 19)
    return h * 5 + C3


@triton.jit
def row_state_tl(seed, position, purpose):
    """Murmur state after the first five words (seed, position: int64; purpose: int32); uint32."""
    seed_lo = seed.to(tl.uint32)
    h = _mix_word_tl(seed_lo ^ seed_lo, seed_lo)
    h = _mix_word_tl(h, (seed >> 32).to(tl.uint32))
    h = _mix_word_tl(h, position.to(tl.uint32))
    h = _mix_word_tl(h, (position >> 32).to(tl.uint32))
    return _mix_word_tl(h, purpose.to(tl.uint32))


@triton.jit
def draw_bits_tl(state, index):
    """The 32 random bits (uint32) of draw `index` (int32) from a row state."""
    h = _mix_word_tl(state, index.to(tl.uint32))
    h = h ^ KEY_BYTES
    h = h ^ (h >> 16)
    h = h * F1
    h = h ^ (h >> 13)
    h = h * F2
    return h ^ (h >> 16)


@triton.jit
def uniform_tl(bits):
    """float32 uniform in [0, 1) from uint32 bits: the top 24 bits, exactly."""
    return (bits >> 8).to(tl.float32) * UNIFORM_SCALE


@triton.jit
def log_tl(x, FAST_LOG: tl.constexpr):
    """log(x); on the GPU through the hardware lg2.approx (a few ulps, far cheaper than libdevice logf)."""
    if FAST_LOG:
        # ftz: the inputs (1 - w, or E >= 2**-33) are never subnormal, so skip the subnormal fixup.
        log2 = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
        return log2 * LN2
    else:
        return tl.log(x)


@triton.jit
def exponential_tl(bits, FAST_LOG: tl.constexpr):
    """float32 standard exponential from uint32 bits (the series below 2**-7 keeps small E exact)."""
    w = bits.to(tl.float32) * EXP_SCALE + EXP_OFFSET
    series = w * (1.0 + w * (0.5 + w * (THIRD + w * 0.25)))
    return tl.where(w < SERIES_BELOW, series, -log_tl(1.0 - w, FAST_LOG))
