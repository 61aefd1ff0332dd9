// CPU kernels of specdec::greedy_verify and specdec::typical_acceptance (and
// their .counted overloads). The contract is in specdec_ops/ops/verify.py.
//
// Rows (b, i) are reduced in parallel: argmax (first NaN, else the largest
// value at the lowest index, as torch.argmax) and, for typical acceptance,
// the entropy accumulated in double. Requests are then assembled serially
// into the create_output layout. Draft ids outside [0, V) are rejected
// without being used as an index.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks.h"

namespace specdec {
namespace {

constexpr double kEntropyEps = 1e-5;

void check_inputs(const char* op, const char* target_name, const at::Tensor& target,
                  const at::Tensor& draft, const at::Tensor* counters) {
  check_draft_ids(op, draft);
  check_rank(op, target_name, target, 3);
  const auto dtype = target.scalar_type();
  SPECDEC_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op, ": argument '",
                target_name, "' must have dtype float16 or bfloat16 or float32, got ", dtype_name(dtype));
  check_cpu(op, target_name, target);
  check_unit_stride(op, target_name, target);
  const int64_t batch = draft.size(0);
  const int64_t k = draft.size(1);
  SPECDEC_CHECK(k >= 1, op, ": argument 'draft_token_ids' must have k >= 1 columns, got shape ",
                draft.sizes());
  check_size(op, target_name, target, 0, batch, "B, rows of draft_token_ids");
  check_size(op, target_name, target, 1, k + 1, "k + 1, one more than the columns of draft_token_ids");
  SPECDEC_CHECK(target.size(2) >= 1, op, ": argument '", target_name,
                "' must have a vocabulary of V >= 1 entries, got shape ", target.sizes());
  if (counters != nullptr) check_counters(op, *counters);
}

// Index of the first NaN, else of the first largest value (torch.argmax).
template <typename T>
int64_t row_argmax(const T* row, int64_t vocab) {
  int64_t best = 0;
  float best_val = static_cast<float>(row[0]);
  if (std::isnan(best_val)) return 0;
  for (int64_t v = 1; v < vocab; ++v) {
    const float x = static_cast<float>(row[v]);
    if (std::isnan(x)) return v;
    if (x > best_val) {
      best_val = x;
      best = v;
    }
  }
  return best;
}

// sum_v p[v] * log(p[v] + eps) = -H(p), in double.
template <typename T>
double row_neg_entropy(const T* row, int64_t vocab) {
  double acc = 0.0;
  for (int64_t v = 0; v < vocab; ++v) {
    const double p = static_cast<double>(static_cast<float>(row[v]));
    acc += p * std::log(p + kEntropyEps);
  }
  return acc;
}

struct TypicalParams {
  double threshold;
  double alpha;
};

// Fills argmax [B*(k+1)] and accepted [B*k]; typical == nullptr means greedy.
template <typename T>
void decide(const at::Tensor& target, const at::Tensor& draft, const TypicalParams* typical,
            std::vector<int64_t>& argmax, std::vector<uint8_t>& accepted) {
  const int64_t batch = draft.size(0);
  const int64_t k = draft.size(1);
  const int64_t vocab = target.size(2);
  const int64_t rows = batch * (k + 1);
  const T* data = target.const_data_ptr<T>();
  const int64_t batch_stride = target.stride(0);
  const int64_t row_stride = target.stride(1);
  const int64_t draft_stride = draft.stride(0);
  // Aim for ~64K elements of work per task.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / vocab);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / (k + 1);
      const int64_t i = r % (k + 1);
      const T* row = data + b * batch_stride + i * row_stride;
      argmax[r] = row_argmax(row, vocab);
      if (i == k) continue;
      const int64_t x = load_int(draft, b * draft_stride + i);
      const bool in_vocab = x >= 0 && x < vocab;
      bool accept = false;
      if (typical == nullptr) {
        accept = in_vocab && x == argmax[r];
      } else if (in_vocab) {
        const double p = static_cast<double>(static_cast<float>(row[x]));
        const double posterior = typical->alpha * std::exp(row_neg_entropy(row, vocab));
        // min(threshold, posterior), NaN (rejecting) if either is NaN, as torch.minimum.
        const bool has_nan = std::isnan(posterior) || std::isnan(typical->threshold);
        accept = !has_nan && p > std::min(typical->threshold, posterior);
      }
      accepted[b * k + i] = accept;
    }
  });
}

at::Tensor verify_impl(const char* op, const char* target_name, const at::Tensor& target,
                       const at::Tensor& draft, const TypicalParams* typical, at::Tensor* counters) {
  check_inputs(op, target_name, target, draft, counters);
  const int64_t batch = draft.size(0);
  const int64_t k = draft.size(1);
  std::vector<int64_t> argmax(batch * (k + 1));
  std::vector<uint8_t> accepted(batch * k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target.scalar_type(), "verify", [&] {
    decide<scalar_t>(target, draft, typical, argmax, accepted);
  });

  at::Tensor out = at::empty({batch, k + 1}, draft.options());
  const int64_t draft_stride = draft.stride(0);
  int64_t num_accepted = 0;
  int64_t num_emitted = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t first_rejected = k;
    for (int64_t i = 0; i < k; ++i) {
      num_accepted += accepted[b * k + i];
      if (!accepted[b * k + i] && first_rejected == k) first_rejected = i;
    }
    // Accepted draft ids and argmaxes are all >= 0: first_rejected + 1 tokens go out,
    // the last one (column first_rejected) being the substitute or, at column k, the bonus.
    for (int64_t i = 0; i <= k; ++i) {
      int64_t v = -1;
      if (i < first_rejected) {
        v = load_int(draft, b * draft_stride + i);
      } else if (i == first_rejected) {
        v = argmax[b * (k + 1) + i];
      }
      store_int(out, b * (k + 1) + i, v);
    }
    num_emitted += first_rejected + 1;
  }
  if (counters != nullptr) add_counters(*counters, num_accepted, num_emitted, batch * k);
  return out;
}

at::Tensor greedy_verify_cpu(const at::Tensor& target_logits, const at::Tensor& draft_token_ids) {
  return verify_impl("greedy_verify", "target_logits", target_logits, draft_token_ids, nullptr, nullptr);
}

at::Tensor greedy_verify_counted_cpu(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                                     at::Tensor counters) {
  return verify_impl("greedy_verify", "target_logits", target_logits, draft_token_ids, nullptr, &counters);
}

void check_typical_params(double posterior_threshold, double posterior_alpha) {
  // !(x >= 0) also refuses NaN.
  SPECDEC_CHECK(posterior_threshold >= 0.0, "typical_acceptance: argument 'posterior_threshold' must be >= 0, got ",
                posterior_threshold);
  SPECDEC_CHECK(posterior_alpha >= 0.0, "typical_acceptance: argument 'posterior_alpha' must be >= 0, got ",
                posterior_alpha);
}

at::Tensor typical_acceptance_cpu(const at::Tensor& target_probs, const at::Tensor& draft_token_ids,
                                  double posterior_threshold, double posterior_alpha) {
  check_typical_params(posterior_threshold, posterior_alpha);
  const TypicalParams params{posterior_threshold, posterior_alpha};
  return verify_impl("typical_acceptance", "target_probs", target_probs, draft_token_ids, &params, nullptr);
}

at::Tensor typical_acceptance_counted_cpu(const at::Tensor& target_probs, const at::Tensor& draft_token_ids,
                                          double posterior_threshold, double posterior_alpha,
                                          at::Tensor counters) {
  check_typical_params(posterior_threshold, posterior_alpha);
  const TypicalParams params{posterior_threshold, posterior_alpha};
  return verify_impl("typical_acceptance", "target_probs", target_probs, draft_token_ids, &params, &counters);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("greedy_verify", &greedy_verify_cpu);
  m.impl("greedy_verify.counted", &greedy_verify_counted_cpu);
  m.impl("typical_acceptance", &typical_acceptance_cpu);
  m.impl("typical_acceptance.counted", &typical_acceptance_counted_cpu);
}

}  // namespace specdec
