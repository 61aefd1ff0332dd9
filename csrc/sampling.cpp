// CPU kernels of specdec::rejection_sample and specdec::sample_draft (and their
// overloads). The contract, including the random streams, is in
// specdec_ops/ops/sampling.py. Unlike the reference, which races every position,
// this kernel evaluates the k accept tests and races over V only at the one
// rejected (or bonus) position of each request.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "checks.h"
#include "random_streams.h"

namespace specdec {
namespace {

constexpr const char* kRejection = "rejection_sample";
// The random streams (MurmurHash3_x86_32 of seed, position, purpose, index) shared with the other C++ kernels.
using streams::draw_bits;
using streams::exponential;
using streams::kAccept;
using streams::kBonus;
using streams::kDraft;
using streams::kResidual;
using streams::row_state;
using streams::uniform;

// --- element access ---------------------------------------------------------------------------

// Reads element `idx` of a float16/bfloat16/float32/float64 buffer as float.
inline float load_float(const void* base, at::ScalarType dtype, int64_t idx) {
  switch (dtype) {
    case at::kFloat: return static_cast<const float*>(base)[idx];
    case at::kHalf: return static_cast<float>(static_cast<const at::Half*>(base)[idx]);
    case at::kBFloat16: return static_cast<float>(static_cast<const at::BFloat16*>(base)[idx]);
    default: return static_cast<float>(static_cast<const double*>(base)[idx]);
  }
}

bool is_prob_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

void check_prob_dtype(const char* op, const char* name, const at::Tensor& t) {
  SPECDEC_CHECK(is_prob_dtype(t.scalar_type()), op, ": argument '", name,
                "' must have dtype float32 or float16 or bfloat16, got ", dtype_name(t.scalar_type()));
}

void check_1d_int64(const char* op, const char* name, const at::Tensor& t, int64_t rows, const char* meaning) {
  check_rank(op, name, t, 1);
  check_dtype(op, name, t, at::kLong);
  check_cpu(op, name, t);
  check_size(op, name, t, 0, rows, meaning);
}

// Segmented race (contract in specdec_ops/ops/sampling.py). tree[0..3] holds a segment's weights on entry;
// build_tree appends the pair sums (tree[4..5]) and the total (tree[6]).
constexpr int64_t kSegment = 4;
constexpr int kTreeSize = 7, kPairs = 4, kTotal = 6;

inline void build_tree(float* tree) {
  tree[kPairs] = tree[0] + tree[1];
  tree[kPairs + 1] = tree[2] + tree[3];
  tree[kTotal] = tree[kPairs] + tree[kPairs + 1];
}

// The leaf whose share of the total holds u * total, walking down from the root.
inline int64_t descend(const float* tree, float u) {
  float threshold = u * tree[kTotal];
  int64_t node = 0;
  for (int offset : {kPairs, 0}) {
    const float left = tree[offset + 2 * node], right = tree[offset + 2 * node + 1];
    const bool go_right = left == 0.0f || (right > 0.0f && threshold >= left);
    if (go_right) threshold -= left;
    node = 2 * node + go_right;
  }
  return node;
}

// The token of the race over weight(0..vocab-1) (>= 0), or -1 when no segment has a positive key.
template <typename Weight>
int64_t segment_race(int64_t vocab, uint32_t state, Weight weight) {
  float tree[kTreeSize];
  auto fill = [&](int64_t segment) {
    for (int64_t t = 0; t < kSegment; ++t) {
      const int64_t v = segment * kSegment + t;
      tree[t] = v < vocab ? weight(v) : 0.0f;
    }
    build_tree(tree);
  };
  int64_t best = -1;
  float best_key = 0.0f;
  for (int64_t segment = 0; segment * kSegment < vocab; ++segment) {
    fill(segment);
    if (!(tree[kTotal] > 0.0f)) continue;  // its key would be 0 (or NaN): it cannot win
    const float key = tree[kTotal] / exponential(draw_bits(state, static_cast<uint32_t>(2 * segment)));
    if (key > best_key) {
      best_key = key;
      best = segment;
    }
  }
  if (best < 0) return -1;
  fill(best);
  return best * kSegment + descend(tree, uniform(draw_bits(state, static_cast<uint32_t>(2 * best + 1))));
}

// --- rejection_sample --------------------------------------------------------------------------

at::Tensor rejection_sample_impl(const at::Tensor& target, const at::Tensor& draft,
                                 const std::optional<at::Tensor>& draft_probs, const at::Tensor& seeds,
                                 const at::Tensor& offsets, const std::optional<at::Tensor>& bonus,
                                 at::Tensor* counters) {
  const char* op = kRejection;
  check_rank(op, "target_probs", target, 3);
  check_prob_dtype(op, "target_probs", target);
  check_cpu(op, "target_probs", target);
  check_unit_stride(op, "target_probs", target);
  const RoundShape shape = check_round_shape(op, "target_probs", target, draft);
  const int64_t batch = shape.batch;
  const int64_t k = shape.k;
  const int64_t vocab = shape.vocab;
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    check_rank(op, "draft_probs", q, 3);
    check_prob_dtype(op, "draft_probs", q);
    check_cpu(op, "draft_probs", q);
    check_unit_stride(op, "draft_probs", q);
    check_size(op, "draft_probs", q, 0, batch, "B, rows of target_probs");
    check_size(op, "draft_probs", q, 1, k, "k, target_probs has k+1 positions");
    check_size(op, "draft_probs", q, 2, vocab, "V, vocabulary of target_probs");
  }
  check_1d_int64(op, "seeds", seeds, batch, "B, rows of target_probs");
  check_1d_int64(op, "offsets", offsets, batch, "B, rows of target_probs");
  if (bonus.has_value()) {
    const at::Tensor& t = *bonus;
    SPECDEC_CHECK(t.dim() == 1 || (t.dim() == 2 && t.size(1) == 1), op,
                  ": argument 'bonus_token_ids' must have shape [B, 1] or [B], got shape ", t.sizes());
    check_int_dtype(op, "bonus_token_ids", t);
    check_cpu(op, "bonus_token_ids", t);
    check_size(op, "bonus_token_ids", t, 0, batch, "B, rows of target_probs");
  }
  if (counters != nullptr) check_counters(op, *counters);

  at::Tensor out = at::empty({batch, k + 1}, draft.options());
  // Strided access throughout: an expanded input (batch stride 0) is never materialized.
  const void* p_base = target.const_data_ptr();
  const at::ScalarType p_dtype = target.scalar_type();
  const int64_t p_sb = target.stride(0), p_si = target.stride(1);
  const bool has_q = draft_probs.has_value();
  const void* q_base = has_q ? draft_probs->const_data_ptr() : nullptr;
  const at::ScalarType q_dtype = has_q ? draft_probs->scalar_type() : at::kFloat;
  const int64_t q_sb = has_q ? draft_probs->stride(0) : 0, q_si = has_q ? draft_probs->stride(1) : 0;
  const int64_t d_sb = draft.stride(0);
  const int64_t* seed_data = seeds.const_data_ptr<int64_t>();
  const int64_t* offset_data = offsets.const_data_ptr<int64_t>();
  const int64_t seed_s = seeds.stride(0), offset_s = offsets.stride(0);

  std::atomic<int64_t> num_accepted{0}, num_emitted{0};
  at::parallel_for(0, batch, 16, [&](int64_t begin, int64_t end) {
    int64_t local_accepted = 0, local_emitted = 0;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t seed = seed_data[b * seed_s];
      const int64_t offset = offset_data[b * offset_s];
      int64_t first_rejected = k;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t x = load_int(draft, b * d_sb + i);
        bool accepted = false;
        if (x >= 0 && x < vocab) {
          const float p_x = load_float(p_base, p_dtype, b * p_sb + i * p_si + x);
          const float q_x = has_q ? load_float(q_base, q_dtype, b * q_sb + i * q_si + x) : 1.0f;
          const float u = uniform(draw_bits(row_state(seed, offset + i, kAccept), 0u));
          accepted = u * q_x < p_x;
        }
        local_accepted += accepted;
        if (!accepted && first_rejected == k) first_rejected = i;
      }
      const int64_t j = first_rejected;
      int64_t token = -1;
      if (j < k || !bonus.has_value()) {
        const uint32_t state = row_state(seed, offset + j, j < k ? kResidual : kBonus);
        const int64_t p_row = b * p_sb + j * p_si;
        const int64_t q_row = b * q_sb + j * q_si;
        const int64_t x_j = j < k ? load_int(draft, b * d_sb + j) : -1;
        auto residual = [&](int64_t v) {
          float q = 0.0f;
          if (j < k) q = has_q ? load_float(q_base, q_dtype, q_row + v) : (v == x_j ? 1.0f : 0.0f);
          return std::max(load_float(p_base, p_dtype, p_row + v) - q, 0.0f);
        };
        token = segment_race(vocab, state, residual);
        if (token < 0) {  // no positive residual key: draw from p_j itself, same random numbers
          token = segment_race(vocab, state, [&](int64_t v) { return load_float(p_base, p_dtype, p_row + v); });
        }
        token = std::min(std::max<int64_t>(token, 0), vocab - 1);  // non-finite rows: stay in [0, V)
      }
      for (int64_t c = 0; c < k; ++c) {
        int64_t v = -1;
        if (c < j) {
          v = load_int(draft, b * d_sb + c);
        } else if (c == j) {
          v = token;
        }
        store_int(out, b * (k + 1) + c, v);
        local_emitted += v != -1;
      }
      int64_t bonus_token = -1;
      if (j == k) bonus_token = bonus.has_value() ? load_int(*bonus, b * bonus->stride(0)) : token;
      store_int(out, b * (k + 1) + k, bonus_token);
      local_emitted += bonus_token != -1;
    }
    num_accepted += local_accepted;
    num_emitted += local_emitted;
  });
  if (counters != nullptr) add_counters(*counters, num_accepted.load(), num_emitted.load(), batch * k);
  return out;
}

at::Tensor rejection_sample_cpu(const at::Tensor& target_probs, const at::Tensor& draft_token_ids,
                                const std::optional<at::Tensor>& draft_probs, const at::Tensor& seeds,
                                const at::Tensor& offsets, const std::optional<at::Tensor>& bonus_token_ids) {
  return rejection_sample_impl(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids,
                               nullptr);
}

at::Tensor rejection_sample_counted_cpu(const at::Tensor& target_probs, const at::Tensor& draft_token_ids,
                                        const std::optional<at::Tensor>& draft_probs, const at::Tensor& seeds,
                                        const at::Tensor& offsets,
                                        const std::optional<at::Tensor>& bonus_token_ids, at::Tensor counters) {
  return rejection_sample_impl(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids,
                               &counters);
}

// --- sample_draft ------------------------------------------------------------------------------

at::Tensor sample_draft_impl(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& seeds,
                             const at::Tensor& positions, at::Tensor* probs) {
  const char* op = probs == nullptr ? "sample_draft" : "sample_draft.with_probs";
  check_rank(op, "logits", logits, 2);
  const at::ScalarType dtype = logits.scalar_type();
  SPECDEC_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble, op,
                ": argument 'logits' must have dtype float16 or bfloat16 or float32 or float64, got ",
                dtype_name(dtype));
  check_cpu(op, "logits", logits);
  check_unit_stride(op, "logits", logits);
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  SPECDEC_CHECK(vocab >= 1, op, ": argument 'logits' must have a vocabulary of V >= 1, got shape ",
                logits.sizes());
  check_rank(op, "temperature", temperature, 1);
  check_dtype(op, "temperature", temperature, at::kFloat);
  check_cpu(op, "temperature", temperature);
  check_size(op, "temperature", temperature, 0, rows, "n, rows of logits");
  check_1d_int64(op, "seeds", seeds, rows, "n, rows of logits");
  check_1d_int64(op, "positions", positions, rows, "n, rows of logits");
  if (probs != nullptr) check_draft_probs_out(op, *probs, rows, vocab);

  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out_data = out.data_ptr<int64_t>();
  const void* base = logits.const_data_ptr();
  const int64_t row_stride = logits.stride(0);
  const float* temps = temperature.const_data_ptr<float>();
  const int64_t* seed_data = seeds.const_data_ptr<int64_t>();
  const int64_t* position_data = positions.const_data_ptr<int64_t>();
  float* probs_data = probs == nullptr ? nullptr : probs->data_ptr<float>();
  const int64_t probs_stride = probs == nullptr ? 0 : probs->stride(0);
  const int64_t temp_s = temperature.stride(0), seed_s = seeds.stride(0), position_s = positions.stride(0);

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float t = temps[r * temp_s];
      const bool is_random = t > 0.0f;
      const int64_t row = r * row_stride;
      const uint32_t state = row_state(seed_data[r * seed_s], position_data[r * position_s], kDraft);
      // Greedy: argmax of the logits; random: argmax of the Gumbel keys z_v - log(E_v), z = x / T.
      int64_t best = 0;
      float best_key = -std::numeric_limits<float>::infinity();
      bool first = true;
      float z_max = -std::numeric_limits<float>::infinity();
      for (int64_t v = 0; v < vocab; ++v) {
        const float x = load_float(base, dtype, row + v);
        float key = x;
        if (is_random) {
          const float z = x / t;
          z_max = std::max(z_max, z);
          key = z - std::log(exponential(draw_bits(state, static_cast<uint32_t>(v))));
        }
        // NaN counts as the largest key, first NaN winning, as torch.argmax does (and the reference).
        if (first || key > best_key || (std::isnan(key) && !std::isnan(best_key))) {
          best_key = key;
          best = v;
          first = false;
        }
      }
      out_data[r] = best;
      if (probs_data != nullptr) {
        float* dst = probs_data + r * probs_stride;
        if (is_random) {
          float total = 0.0f;
          for (int64_t v = 0; v < vocab; ++v) {
            dst[v] = std::exp(load_float(base, dtype, row + v) / t - z_max);
            total += dst[v];
          }
          const float inv_total = 1.0f / total;
          for (int64_t v = 0; v < vocab; ++v) dst[v] *= inv_total;
        } else {
          for (int64_t v = 0; v < vocab; ++v) dst[v] = v == best ? 1.0f : 0.0f;
        }
      }
    }
  });
  return out;
}

at::Tensor sample_draft_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& seeds,
                            const at::Tensor& positions) {
  return sample_draft_impl(logits, temperature, seeds, positions, nullptr);
}

at::Tensor sample_draft_with_probs_cpu(const at::Tensor& logits, const at::Tensor& temperature,
                                       const at::Tensor& seeds, const at::Tensor& positions, at::Tensor probs) {
  return sample_draft_impl(logits, temperature, seeds, positions, &probs);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("rejection_sample", &rejection_sample_cpu);
  m.impl("rejection_sample.counted", &rejection_sample_counted_cpu);
  m.impl("sample_draft", &sample_draft_cpu);
  m.impl("sample_draft.with_probs", &sample_draft_with_probs_cpu);
}

}  // namespace specdec
