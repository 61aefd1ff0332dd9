"""Named constants of the Triton kernels, as tl.constexpr (Triton compiles them in like literals).

The values come from the contract modules, so the references and the kernels cannot disagree on them.
"""
import triton.language as tl

from ..ops import counter_hash, sampling, verify

# Purposes of the counter-based hash (ops/counter_hash.py).
DRAFT = tl.constexpr(counter_hash.DRAFT)
ACCEPT = tl.constexpr(counter_hash.ACCEPT)
RESIDUAL = tl.constexpr(counter_hash.RESIDUAL)
BONUS = tl.constexpr(counter_hash.BONUS)

# The hash itself.
C1 = tl.constexpr(counter_hash.C1)
C2 = tl.constexpr(counter_hash.C2)
C3 = tl.constexpr(counter_hash.C3)
F1 = tl.constexpr(counter_hash.F1)
F2 = tl.constexpr(counter_hash.F2)
KEY_BYTES = tl.constexpr(counter_hash.KEY_BYTES)

# Uniforms and exponentials from its bits.
UNIFORM_SCALE = tl.constexpr(counter_hash.UNIFORM_SCALE)
EXP_SCALE = tl.constexpr(counter_hash.EXP_SCALE)
EXP_OFFSET = tl.constexpr(counter_hash.EXP_OFFSET)
THIRD = tl.constexpr(counter_hash.THIRD)
SERIES_BELOW = tl.constexpr(counter_hash.SERIES_BELOW)
LN2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * LN2

# Vocabulary entries per race segment of rejection_sample (part of its random stream).
SEGMENT = tl.constexpr(sampling.SEGMENT)

# typical_acceptance's entropy: H(p) = -sum p log(p + ENTROPY_EPS).
ENTROPY_EPS = tl.constexpr(verify.ENTROPY_EPS)

# Larger than any vocabulary index: the identity of a min over indices.
NO_INDEX = tl.constexpr(2147483647)
