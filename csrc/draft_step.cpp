// CPU kernel of specdec::advance_draft_step. The contract is in
// specdec_ops/ops/draft_step.py; the arithmetic is done in int64 like the
// Triton kernel, so both clamp instead of wrapping at the int32 maximum.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "checks.h"

namespace specdec {
namespace {

constexpr const char* kOp = "advance_draft_step";

std::tuple<at::Tensor, at::Tensor, at::Tensor> advance_draft_step_cpu(const at::Tensor& sampled_token_ids,
                                                                      const at::Tensor& positions,
                                                                      const at::Tensor& seq_lens,
                                                                      int64_t max_model_len) {
  const std::pair<const char*, const at::Tensor*> args[] = {
      {"sampled_token_ids", &sampled_token_ids}, {"positions", &positions}, {"seq_lens", &seq_lens}};
  for (const auto& [name, t] : args) {
    check_rank(kOp, name, *t, 1);
    check_int_dtype(kOp, name, *t);
    check_cpu(kOp, name, *t);
    check_unit_stride(kOp, name, *t);
  }
  const int64_t n = sampled_token_ids.size(0);
  check_size(kOp, "positions", positions, 0, n, "n, the length of sampled_token_ids");
  check_size(kOp, "seq_lens", seq_lens, 0, n, "n, the length of sampled_token_ids");
  SPECDEC_CHECK(max_model_len >= 1, kOp, ": argument 'max_model_len' must be >= 1, got ", max_model_len);

  at::Tensor input_ids = at::empty({n}, sampled_token_ids.options().dtype(at::kInt));
  at::Tensor next_positions = at::empty({n}, positions.options());
  at::Tensor next_seq_lens = at::empty({n}, seq_lens.options());
  int32_t* ids = input_ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    ids[i] = static_cast<int32_t>(load_int(sampled_token_ids, i));
    store_int(next_positions, i, std::min(load_int(positions, i) + 1, max_model_len - 1));
    store_int(next_seq_lens, i, std::min(load_int(seq_lens, i) + 1, max_model_len));
  }
  return {input_ids, next_positions, next_seq_lens};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("advance_draft_step", &advance_draft_step_cpu); }

}  // namespace specdec
