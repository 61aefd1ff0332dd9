// The counter-based random streams and the segmented race of specdec_ops/ops/sampling.py ("Randomness"), for every
// C++ kernel: MurmurHash3_x86_32 of (seed lo, seed hi,
// position lo, position hi, purpose, index), the uniform and exponential built from the 32 bits, and the race over
// segments of 4 entries. Every kernel must make these exact float operations in this order.
#pragma once
#include <cmath>
#include <cstdint>

namespace specdec {
namespace streams {

constexpr uint32_t kDraft = 1, kAccept = 2, kResidual = 3, kBonus = 4;

inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

inline uint32_t mix_word(uint32_t h, uint32_t word) {
  word *= 0xCC9E2D51u;
  word = rotl32(word, 15);
  word *= 0x1B873593u;
  h ^= word;
  h = rotl32(h, 13);
  return h * 5u + 0xE6546B64u;
}

// Hash state after the first five words; a draw then only mixes in its index.
inline uint32_t row_state(int64_t seed, int64_t position, uint32_t purpose) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint64_t p = static_cast<uint64_t>(position);
  uint32_t h = mix_word(0u, static_cast<uint32_t>(s));
  h = mix_word(h, static_cast<uint32_t>(s >> 32));
  h = mix_word(h, static_cast<uint32_t>(p));
  h = mix_word(h, static_cast<uint32_t>(p >> 32));
  return mix_word(h, purpose);
}

inline uint32_t draw_bits(uint32_t state, uint32_t index) {
  uint32_t h = mix_word(state, index) ^ 24u;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

inline float uniform(uint32_t bits) { return static_cast<float>(bits >> 8) * 5.960464477539063e-08f; }

inline float exponential(uint32_t bits) {
  const float w = static_cast<float>(bits) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
  if (w < 0.0078125f) return w * (1.0f + w * (0.5f + w * (0.3333333432674408f + w * 0.25f)));
  return -std::log(1.0f - w);
}

// The token of the segmented race over weight(0..vocab-1) (>= 0), or -1 when no segment has a positive key.
template <typename Weight>
int64_t segment_race(int64_t vocab, uint32_t state, Weight weight) {
  constexpr int64_t kSegment = 4;
  float leaf[4], pair[2], total = 0.0f;
  auto fill = [&](int64_t segment) {
    for (int64_t t = 0; t < kSegment; ++t) {
      const int64_t v = segment * kSegment + t;
      leaf[t] = v < vocab ? weight(v) : 0.0f;
    }
    pair[0] = leaf[0] + leaf[1];
    pair[1] = leaf[2] + leaf[3];
    total = pair[0] + pair[1];
  };
  int64_t best = -1;
  float best_key = 0.0f;
  for (int64_t segment = 0; segment * kSegment < vocab; ++segment) {
    fill(segment);
    if (!(total > 0.0f)) continue;  // its key would be 0 (or NaN): it cannot win
    const float key = total / exponential(draw_bits(state, static_cast<uint32_t>(2 * segment)));
    if (key > best_key) {
      best_key = key;
      best = segment;
    }
  }
  if (best < 0) return -1;
  fill(best);
  // Down the pair tree: go right if the left weight is 0, or the right one is positive and the threshold passed
  // the left weight.
  float threshold = uniform(draw_bits(state, static_cast<uint32_t>(2 * best + 1))) * total;
  int64_t node = 0;
  const float* levels[2] = {pair, leaf};
  for (const float* level : levels) {
    const float left = level[2 * node], right = level[2 * node + 1];
    const bool go_right = left == 0.0f || (right > 0.0f && threshold >= left);
    if (go_right) threshold -= left;
    node = 2 * node + go_right;
  }
  return best * kSegment + node;
}

}  // namespace streams
}  // namespace specdec
