// CPU kernels of specdec::rejection_sample_logits and specdec::sample_draft_filtered (and their overloads). The
// contract, the processed distribution included, is in specdec_ops/ops/logits_sampling.py. Per row the kernel
// finds the top-k threshold with nth_element and the top-p threshold by sorting only the top-k set (the GPU kernel
// searches thresholds instead); masses are summed in double along the sorted order, as in the reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "random_streams.h"

namespace specdec {
namespace {

using namespace streams;

// An optional input: a draft distribution, or a filter (absent: off for the whole batch).
using OptionalTensor = std::optional<at::Tensor>;

constexpr const char* kRejection = "rejection_sample_logits";
constexpr float kInf = std::numeric_limits<float>::infinity();

inline float load_float(const void* base, at::ScalarType dtype, int64_t idx) {
  switch (dtype) {
    case at::kFloat: return static_cast<const float*>(base)[idx];
    case at::kHalf: return static_cast<float>(static_cast<const at::Half*>(base)[idx]);
    default: return static_cast<float>(static_cast<const at::BFloat16*>(base)[idx]);
  }
}

void check_logit_tensor(const char* op, const char* name, const at::Tensor& t, int64_t ndim) {
  check_rank(op, name, t, ndim);
  const at::ScalarType d = t.scalar_type();
  SPECDEC_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, op, ": argument '", name,
                "' must have dtype float32 or bfloat16 or float16, got ", dtype_name(d));
  check_cpu(op, name, t);
  check_unit_stride(op, name, t);
}

void check_vector(const char* op, const char* name, const at::Tensor& t, int64_t rows, const char* meaning,
                  bool integer, at::ScalarType dtype) {
  check_rank(op, name, t, 1);
  if (integer) {
    check_int_dtype(op, name, t);
  } else {
    check_dtype(op, name, t, dtype);
  }
  check_cpu(op, name, t);
  check_size(op, name, t, 0, rows, meaning);
}

void check_params(const char* op, const at::Tensor& temperature, const OptionalTensor& top_k,
                  const OptionalTensor& top_p, const OptionalTensor& min_p, int64_t rows, const char* meaning) {
  check_vector(op, "temperature", temperature, rows, meaning, false, at::kFloat);
  // An absent filter is off for every row.
  if (top_k.has_value()) check_vector(op, "top_k", *top_k, rows, meaning, true, at::kLong);
  if (top_p.has_value()) check_vector(op, "top_p", *top_p, rows, meaning, false, at::kFloat);
  if (min_p.has_value()) check_vector(op, "min_p", *min_p, rows, meaning, false, at::kFloat);
}

// One request's sampling parameters, read from the [B] tensors.
struct Params {
  float temperature;
  int64_t top_k;
  float top_p;
  float min_p;
  bool greedy() const { return !(temperature > 0.0f); }
};

Params read_params(const at::Tensor& temperature, const OptionalTensor& top_k, const OptionalTensor& top_p,
                   const OptionalTensor& min_p, int64_t b) {
  auto value = [b](const OptionalTensor& t, float off) {
    return t.has_value() ? t->const_data_ptr<float>()[b * t->stride(0)] : off;
  };
  return {temperature.const_data_ptr<float>()[b * temperature.stride(0)],
          top_k.has_value() ? load_int(*top_k, b * top_k->stride(0)) : 0, value(top_p, 1.0f), value(min_p, 0.0f)};
}

// The processed distribution of one logit row (contract in the Python module): what a probability needs.
struct Row {
  const void* base = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t offset = 0;  // element offset of the row
  int64_t vocab = 0;
  float temperature = 1.0f;
  bool greedy = false;
  int64_t argmax = 0;
  float m = 0.0f, tau = -kInf, min_e = 0.0f, inv_mass_f = 0.0f;
  float mass_f = 0.0f;  // S rounded to float32, the divisor of every probability
  double mass = 0.0;

  float x(int64_t v) const { return load_float(base, dtype, offset + v); }
  float z(int64_t v) const { return x(v) / temperature; }
  // Whether v is kept, and its unnormalized weight e_v = exp(z_v - m).
  bool kept(float zv, float ev) const { return zv >= tau && ev >= min_e; }
  float prob(int64_t v) const {
    if (greedy) return v == argmax ? 1.0f : 0.0f;
    const float zv = z(v);
    const float ev = std::exp(zv - m);
    return kept(zv, ev) ? ev / mass_f : 0.0f;
  }
  float logprob(int64_t v) const {
    if (greedy) return 0.0f;
    const float zv = z(v);
    const float ev = std::exp(zv - m);
    if (!kept(zv, ev)) return -kInf;
    return static_cast<float>(static_cast<double>(zv - m) - std::log(mass));
  }
};

Row process_row(const void* base, at::ScalarType dtype, int64_t offset, int64_t vocab, const Params& params,
                std::vector<float>& scratch) {
  Row row;
  row.base = base;
  row.dtype = dtype;
  row.offset = offset;
  row.vocab = vocab;
  row.greedy = params.greedy();
  // Greedy: argmax of the float32 logits, first index on ties (torch.argmax); NaN wins, as there.
  float best = row.x(0);
  for (int64_t v = 1; v < vocab; ++v) {
    const float xv = row.x(v);
    if (!(xv <= best) && !std::isnan(best)) {
      best = xv;
      row.argmax = v;
    }
  }
  if (row.greedy) return row;
  row.temperature = params.temperature;
  float m = -kInf;
  for (int64_t v = 0; v < vocab; ++v) m = std::max(m, row.z(v));
  row.m = m;
  const bool k_on = params.top_k > 0 && params.top_k < vocab;
  const bool p_on = params.top_p < 1.0f;  // NaN: off
  row.min_e = params.min_p > 0.0f ? std::min(params.min_p, 1.0f) : 0.0f;
  float tau_k = -kInf;
  if (k_on) {
    scratch.resize(vocab);
    for (int64_t v = 0; v < vocab; ++v) {
      const float zv = row.z(v);
      scratch[v] = std::isnan(zv) ? -kInf : zv;  // a strict weak order for nth_element (NaN rows: unspecified)
    }
    std::nth_element(scratch.begin(), scratch.begin() + (params.top_k - 1), scratch.end(), std::greater<float>());
    tau_k = scratch[params.top_k - 1];
  }
  row.tau = tau_k;
  if (p_on) {
    scratch.clear();
    for (int64_t v = 0; v < vocab; ++v) {
      const float zv = row.z(v);
      if (zv >= tau_k) scratch.push_back(zv);  // never NaN
    }
    std::sort(scratch.begin(), scratch.end(), std::greater<float>());
    if (scratch.empty()) return row;  // an all-NaN row: unspecified tokens
    // Cumulative masses along the sorted order; the first index reaching top_p of the top-k mass gives tau_p.
    std::vector<double> cumulative(scratch.size());
    double running = 0.0;
    for (size_t j = 0; j < scratch.size(); ++j) {
      running += static_cast<double>(std::exp(scratch[j] - m));
      cumulative[j] = running;
    }
    const double target = static_cast<double>(params.top_p) * running;
    size_t first = 0;
    while (first + 1 < cumulative.size() && cumulative[first] < target) ++first;
    row.tau = std::max(tau_k, scratch[first]);
  }
  double mass = 0.0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float zv = row.z(v);
    const float ev = std::exp(zv - m);
    if (row.kept(zv, ev)) mass += ev;
  }
  row.mass = mass;
  row.mass_f = static_cast<float>(mass);
  return row;
}

// --- rejection_sample_logits ---------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> rejection_impl(
    const at::Tensor& target, const at::Tensor& draft, const OptionalTensor& draft_probs,
    const OptionalTensor& draft_logits, const at::Tensor& temperature, const OptionalTensor& top_k,
    const OptionalTensor& top_p, const OptionalTensor& min_p, const at::Tensor& seeds, const at::Tensor& offsets,
    bool block, at::Tensor* counters, bool with_logprobs) {
  const char* op = kRejection;
  check_logit_tensor(op, "target_logits", target, 3);
  const RoundShape shape = check_round_shape(op, "target_logits", target, draft);
  const int64_t batch = shape.batch;
  const int64_t k = shape.k;
  const int64_t vocab = shape.vocab;
  SPECDEC_CHECK(!(draft_probs.has_value() && draft_logits.has_value()), op,
                ": pass at most one of 'draft_probs' and 'draft_logits', got both");
  const OptionalTensor& q_tensor = draft_probs.has_value() ? draft_probs : draft_logits;
  const char* q_name = draft_probs.has_value() ? "draft_probs" : "draft_logits";
  if (q_tensor.has_value()) {
    const at::Tensor& q = *q_tensor;
    check_logit_tensor(op, q_name, q, 3);
    check_size(op, q_name, q, 0, batch, "B, rows of target_logits");
    check_size(op, q_name, q, 1, k, "k, target_logits has k+1 positions");
    check_size(op, q_name, q, 2, vocab, "V, vocabulary of target_logits");
  }
  check_params(op, temperature, top_k, top_p, min_p, batch, "B, rows of target_logits");
  check_vector(op, "seeds", seeds, batch, "B, rows of target_logits", false, at::kLong);
  check_vector(op, "offsets", offsets, batch, "B, rows of target_logits", false, at::kLong);
  if (counters != nullptr) check_counters(op, *counters);

  at::Tensor out = at::empty({batch, k + 1}, draft.options());
  at::Tensor logprobs = with_logprobs ? at::empty({batch, k + 1}, target.options().dtype(at::kFloat)) : at::Tensor();
  float* logprob_data = with_logprobs ? logprobs.data_ptr<float>() : nullptr;
  const void* p_base = target.const_data_ptr();
  const at::ScalarType p_dtype = target.scalar_type();
  const int64_t p_sb = target.stride(0), p_si = target.stride(1);
  const bool has_probs = draft_probs.has_value(), has_logits = draft_logits.has_value();
  const void* q_base = q_tensor.has_value() ? q_tensor->const_data_ptr() : nullptr;
  const at::ScalarType q_dtype = q_tensor.has_value() ? q_tensor->scalar_type() : at::kFloat;
  const int64_t q_sb = q_tensor.has_value() ? q_tensor->stride(0) : 0;
  const int64_t q_si = q_tensor.has_value() ? q_tensor->stride(1) : 0;
  const int64_t d_sb = draft.stride(0);
  const int64_t* seed_data = seeds.const_data_ptr<int64_t>();
  const int64_t* offset_data = offsets.const_data_ptr<int64_t>();
  const int64_t seed_s = seeds.stride(0), offset_s = offsets.stride(0);

  std::atomic<int64_t> num_accepted{0}, num_emitted{0};
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<Row> p_rows(k + 1), q_rows(has_logits ? k : 0);
    std::vector<int64_t> x(k);
    std::vector<float> p_x(k), q_x(k), u(k), weight(k + 1);
    int64_t local_accepted = 0, local_emitted = 0;
    for (int64_t b = begin; b < end; ++b) {
      const Params params = read_params(temperature, top_k, top_p, min_p, b);
      const int64_t seed = seed_data[b * seed_s], offset = offset_data[b * offset_s];
      for (int64_t i = 0; i <= k; ++i) p_rows[i] = process_row(p_base, p_dtype, b * p_sb + i * p_si, vocab, params,
                                                                scratch);
      for (int64_t i = 0; i < static_cast<int64_t>(q_rows.size()); ++i) {
        q_rows[i] = process_row(q_base, q_dtype, b * q_sb + i * q_si, vocab, params, scratch);
      }
      // q_i(v): the processed draft row, the given probabilities, or one-hot at the draft token.
      auto q_prob = [&](int64_t i, int64_t v) -> float {
        if (has_logits) return q_rows[i].prob(v);
        if (has_probs) return load_float(q_base, q_dtype, b * q_sb + i * q_si + v);
        return v == x[i] ? 1.0f : 0.0f;
      };
      int64_t stop = k;  // the first rejected position (token-wise) or tau (block): the emitted prefix length
      int64_t accepted_here = 0;
      for (int64_t i = 0; i < k; ++i) {
        x[i] = load_int(draft, b * d_sb + i);
        const bool valid = x[i] >= 0 && x[i] < vocab;
        p_x[i] = valid ? p_rows[i].prob(x[i]) : 0.0f;
        q_x[i] = valid ? q_prob(i, x[i]) : 0.0f;
        u[i] = uniform(draw_bits(row_state(seed, offset + i, kAccept), 0u));
      }
      if (params.greedy()) {
        for (int64_t i = k - 1; i >= 0; --i) {
          const bool match = x[i] >= 0 && x[i] < vocab && x[i] == p_rows[i].argmax;
          if (!match) stop = i;
          if (!block) accepted_here += match;
        }
        if (block) accepted_here = stop;
      } else if (!block) {
        for (int64_t i = k - 1; i >= 0; --i) {
          const bool valid = x[i] >= 0 && x[i] < vocab;
          const bool accepted = valid && u[i] * q_x[i] < p_x[i];
          if (!accepted) stop = i;
          accepted_here += accepted;
        }
      } else {
        weight[0] = 1.0f;
        for (int64_t i = 1; i <= k; ++i) {
          const float scaled = weight[i - 1] * p_x[i - 1];
          const float ratio = q_x[i - 1] <= scaled ? 1.0f : scaled / q_x[i - 1];
          // A weight that reached 0 stays 0 (q_{i-1}(x_{i-1}) == 0 would otherwise compare 0 <= 0 and revive it).
          const bool valid = x[i - 1] >= 0 && x[i - 1] < vocab;
          const bool dead = weight[i - 1] == 0.0f || p_x[i - 1] == 0.0f || !valid;
          weight[i] = dead ? 0.0f : ratio;
        }
        stop = u[k - 1] < weight[k] ? k : 0;
        for (int64_t i = k - 1; i >= 1 && stop == 0; --i) {
          if (!(weight[i] > 0.0f)) continue;  // no stop where the weight is 0 (or NaN)
          double residual = 0.0;
          for (int64_t v = 0; v < vocab; ++v) {
            residual += std::max(weight[i] * p_rows[i].prob(v) - q_prob(i, v), 0.0f);
          }
          const float mass = static_cast<float>(residual);
          if (u[i - 1] * (mass + (1.0f - weight[i])) < mass) stop = i;
        }
        accepted_here = stop;
      }
      const int64_t j = stop;
      if (!block) {
        for (int64_t i = 0; i < k; ++i) weight[i] = 1.0f;
      }
      int64_t token;
      if (params.greedy()) {
        token = p_rows[j].argmax;
      } else {
        const Row& pj = p_rows[j];
        const uint32_t state = row_state(seed, offset + j, j < k ? kResidual : kBonus);
        const float w = j < k ? weight[j] : 1.0f;
        token = segment_race(vocab, state, [&](int64_t v) {
          const float q = j < k ? q_prob(j, v) : 0.0f;
          return std::max(w * pj.prob(v) - q, 0.0f);
        });
        if (token < 0) token = segment_race(vocab, state, [&](int64_t v) { return pj.prob(v); });
        token = std::min(std::max<int64_t>(token, 0), vocab - 1);  // non-finite rows: stay in [0, V)
      }
      for (int64_t c = 0; c <= k; ++c) {
        int64_t v = -1;
        if (c < j) {
          v = x[c];
        } else if (c == j) {
          v = token;
        }
        store_int(out, b * (k + 1) + c, v);
        local_emitted += v != -1;
        if (logprob_data != nullptr) {
          // Emitted ids are in [0, V); clamp anyway so that no input value can read out of bounds.
          const int64_t safe_v = std::min(std::max<int64_t>(v, 0), vocab - 1);
          logprob_data[b * (k + 1) + c] = v == -1 ? 0.0f : p_rows[c].logprob(safe_v);
        }
      }
      local_accepted += accepted_here;
    }
    num_accepted += local_accepted;
    num_emitted += local_emitted;
  });
  if (counters != nullptr) add_counters(*counters, num_accepted.load(), num_emitted.load(), batch * k);
  return {out, logprobs};
}

at::Tensor rejection_cpu(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                         const OptionalTensor& draft_probs, const OptionalTensor& draft_logits,
                         const at::Tensor& temperature, const OptionalTensor& top_k, const OptionalTensor& top_p,
                         const OptionalTensor& min_p, const at::Tensor& seeds, const at::Tensor& offsets,
                         bool block_verification) {
  return std::get<0>(rejection_impl(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k,
                                    top_p, min_p, seeds, offsets, block_verification, nullptr, false));
}

at::Tensor rejection_counted_cpu(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                                 const OptionalTensor& draft_probs,
                                 const OptionalTensor& draft_logits, const at::Tensor& temperature,
                                 const OptionalTensor& top_k, const OptionalTensor& top_p, const OptionalTensor& min_p,
                                 const at::Tensor& seeds, const at::Tensor& offsets, bool block_verification,
                                 at::Tensor counters) {
  return std::get<0>(rejection_impl(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k,
                                    top_p, min_p, seeds, offsets, block_verification, &counters, false));
}

std::tuple<at::Tensor, at::Tensor> rejection_logprobs_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_token_ids, const OptionalTensor& draft_probs,
    const OptionalTensor& draft_logits, const at::Tensor& temperature, const OptionalTensor& top_k,
    const OptionalTensor& top_p, const OptionalTensor& min_p, const at::Tensor& seeds, const at::Tensor& offsets,
    bool block_verification) {
  return rejection_impl(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p, min_p,
                        seeds, offsets, block_verification, nullptr, true);
}

std::tuple<at::Tensor, at::Tensor> rejection_logprobs_counted_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_token_ids, const OptionalTensor& draft_probs,
    const OptionalTensor& draft_logits, const at::Tensor& temperature, const OptionalTensor& top_k,
    const OptionalTensor& top_p, const OptionalTensor& min_p, const at::Tensor& seeds, const at::Tensor& offsets,
    bool block_verification, at::Tensor counters) {
  return rejection_impl(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p, min_p,
                        seeds, offsets, block_verification, &counters, true);
}

// --- sample_draft_filtered -----------------------------------------------------------------------------------

at::Tensor draft_impl(const at::Tensor& logits, const at::Tensor& temperature, const OptionalTensor& top_k,
                      const OptionalTensor& top_p, const OptionalTensor& min_p, const at::Tensor& seeds,
                      const at::Tensor& positions, at::Tensor* probs) {
  const char* op = probs == nullptr ? "sample_draft_filtered" : "sample_draft_filtered.with_probs";
  check_logit_tensor(op, "logits", logits, 2);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  SPECDEC_CHECK(vocab >= 1, op, ": argument 'logits' must have a vocabulary of V >= 1, got shape ", logits.sizes());
  check_params(op, temperature, top_k, top_p, min_p, rows, "n, rows of logits");
  check_vector(op, "seeds", seeds, rows, "n, rows of logits", false, at::kLong);
  check_vector(op, "positions", positions, rows, "n, rows of logits", false, at::kLong);
  if (probs != nullptr) check_draft_probs_out(op, *probs, rows, vocab);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out_data = out.data_ptr<int64_t>();
  const void* base = logits.const_data_ptr();
  const at::ScalarType dtype = logits.scalar_type();
  const int64_t row_stride = logits.stride(0);
  float* probs_data = probs == nullptr ? nullptr : probs->data_ptr<float>();
  const int64_t probs_stride = probs == nullptr ? 0 : probs->stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t r = begin; r < end; ++r) {
      const Params params = read_params(temperature, top_k, top_p, min_p, r);
      const Row row = process_row(base, dtype, r * row_stride, vocab, params, scratch);
      int64_t token = row.argmax;
      if (!row.greedy) {
        // The Gumbel race of sample_draft over the kept entries: argmax z_v - log(E_v), first index on ties.
        const uint32_t state = row_state(seeds.const_data_ptr<int64_t>()[r * seeds.stride(0)],
                                         positions.const_data_ptr<int64_t>()[r * positions.stride(0)], kDraft);
        float best_key = -kInf;
        int64_t best = -1;
        for (int64_t v = 0; v < vocab; ++v) {
          const float zv = row.z(v);
          if (!row.kept(zv, std::exp(zv - row.m))) continue;
          const float key = zv - std::log(exponential(draw_bits(state, static_cast<uint32_t>(v))));
          if (best < 0 || key > best_key) {
            best_key = key;
            best = v;
          }
        }
        token = best < 0 ? 0 : best;
      }
      out_data[r] = token;
      if (probs_data != nullptr) {
        float* dst = probs_data + r * probs_stride;
        for (int64_t v = 0; v < vocab; ++v) dst[v] = row.prob(v);
      }
    }
  });
  return out;
}

at::Tensor draft_cpu(const at::Tensor& logits, const at::Tensor& temperature, const OptionalTensor& top_k,
                     const OptionalTensor& top_p, const OptionalTensor& min_p, const at::Tensor& seeds,
                     const at::Tensor& positions) {
  return draft_impl(logits, temperature, top_k, top_p, min_p, seeds, positions, nullptr);
}

at::Tensor draft_with_probs_cpu(const at::Tensor& logits, const at::Tensor& temperature, const OptionalTensor& top_k,
                                const OptionalTensor& top_p, const OptionalTensor& min_p, const at::Tensor& seeds,
                                const at::Tensor& positions, at::Tensor probs) {
  return draft_impl(logits, temperature, top_k, top_p, min_p, seeds, positions, &probs);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("rejection_sample_logits", &rejection_cpu);
  m.impl("rejection_sample_logits.counted", &rejection_counted_cpu);
  m.impl("rejection_sample_logits.logprobs", &rejection_logprobs_cpu);
  m.impl("rejection_sample_logits.logprobs_counted", &rejection_logprobs_counted_cpu);
  m.impl("sample_draft_filtered", &draft_cpu);
  m.impl("sample_draft_filtered.with_probs", &draft_with_probs_cpu);
}

}  // namespace specdec
