// CPU kernel and C++ CUDA launcher of specdec::prepare_prefill and
// specdec::prepare_prefill_into. The contract is in specdec_ops/ops/prefill.py.
// Out-of-range input values are clamped, as in the Triton kernel, so that no
// value can make either kernel read or write out of bounds. The rows they
// affect are unspecified, and there the two kernels may differ (values beyond
// int32, a non-monotone query_start_loc).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "checks.h"
#include "triton_launch.h"

namespace specdec {
namespace {

constexpr const char* kOp = "prepare_prefill";

void check_inputs(const at::Tensor& input_ids, const at::Tensor& positions,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                  const at::Tensor& idx_mapping, const at::Tensor& last_sampled,
                  const at::Tensor& num_rejected, int64_t max_model_len) {
  const c10::Device device = input_ids.device();
  const std::pair<const char*, const at::Tensor*> args[] = {
      {"input_ids", &input_ids},     {"positions", &positions},     {"query_start_loc", &query_start_loc},
      {"seq_lens", &seq_lens},       {"idx_mapping", &idx_mapping}, {"last_sampled", &last_sampled},
      {"num_rejected", &num_rejected}};
  for (const auto& [name, t] : args) {
    check_rank(kOp, name, *t, 1);
    check_int_dtype(kOp, name, *t);
    check_device(kOp, name, *t, device);
    check_unit_stride(kOp, name, *t);
  }
  const int64_t num_reqs = query_start_loc.size(0) - 1;
  SPECDEC_CHECK(num_reqs >= 0, kOp, ": argument 'query_start_loc' must have num_reqs + 1 >= 1 entries, got 0");
  check_size(kOp, "positions", positions, 0, input_ids.size(0), "num_tokens, the length of input_ids");
  check_size(kOp, "seq_lens", seq_lens, 0, num_reqs, "num_reqs, len(query_start_loc) - 1");
  check_size(kOp, "idx_mapping", idx_mapping, 0, num_reqs, "num_reqs, len(query_start_loc) - 1");
  check_size(kOp, "num_rejected", num_rejected, 0, num_reqs, "num_reqs, len(query_start_loc) - 1");
  SPECDEC_CHECK(num_reqs == 0 || last_sampled.size(0) >= 1, kOp,
                ": argument 'last_sampled' must hold one token per request slot, got 0 entries");
  SPECDEC_CHECK(max_model_len >= 1, kOp, ": argument 'max_model_len' must be >= 1, got ", max_model_len);
}

void run_cpu(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& query_start_loc,
             const at::Tensor& seq_lens, const at::Tensor& idx_mapping, const at::Tensor& last_sampled,
             const at::Tensor& num_rejected, int64_t max_model_len, at::Tensor& out_ids, at::Tensor& out_pos,
             at::Tensor& out_last, at::Tensor& out_qsl, at::Tensor& out_seq_lens) {
  const int64_t num_tokens = input_ids.size(0);
  const int64_t num_reqs = query_start_loc.size(0) - 1;
  const int64_t max_num_reqs = out_last.size(0);
  const int64_t num_slots = last_sampled.size(0);
  const int64_t total = num_tokens + num_reqs;

  int64_t* pos = out_pos.data_ptr<int64_t>();
  int64_t* last = out_last.data_ptr<int64_t>();
  int32_t* qsl_out = out_qsl.data_ptr<int32_t>();
  int32_t* seq_out = out_seq_lens.data_ptr<int32_t>();

  // Slots no request covers (batch padding past query_start_loc[num_reqs])
  // hold token 0 at position 0.
  for (int64_t j = 0; j < total; ++j) {
    store_int(out_ids, j, 0);
    pos[j] = 0;
  }
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t raw_start = load_int(query_start_loc, i);
    const int64_t q_start = std::clamp<int64_t>(raw_start, 0, num_tokens);
    const int64_t q_end = std::clamp<int64_t>(load_int(query_start_loc, i + 1), q_start, num_tokens);
    const int64_t query_len = q_end - q_start;
    const int64_t rejected = std::clamp<int64_t>(load_int(num_rejected, i), 0, query_len);
    const int64_t num_valid = query_len - rejected;
    const int64_t slot = std::clamp<int64_t>(load_int(idx_mapping, i), 0, num_slots - 1);
    const int64_t correction = load_int(last_sampled, slot);
    const int64_t start_pos = query_len > 0 ? load_int(positions, q_start) : 0;
    const int64_t out_start = raw_start + i;
    for (int64_t s = 0; s <= query_len; ++s) {
      const int64_t j = out_start + s;
      if (j < 0 || j >= total) continue;
      store_int(out_ids, j, s < num_valid ? load_int(input_ids, q_start + s) : (s == num_valid ? correction : 0));
      pos[j] = std::min(start_pos + s, max_model_len - 1);
    }
    last[i] = out_start + num_valid;
    qsl_out[i] = static_cast<int32_t>(out_start);
    seq_out[i] = static_cast<int32_t>(std::min(load_int(seq_lens, i) + 1, max_model_len));
  }
  for (int64_t r = num_reqs; r < max_num_reqs; ++r) {
    last[r] = 0;
    seq_out[r] = 0;
  }
  for (int64_t r = num_reqs; r <= max_num_reqs; ++r) qsl_out[r] = static_cast<int32_t>(total);
}

// The Triton kernel (specdec_ops/kernels/prefill.py), launched from C++: one launch whose grid depends only on shapes.
void run_cuda(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& query_start_loc,
              const at::Tensor& seq_lens, const at::Tensor& idx_mapping, const at::Tensor& last_sampled,
              const at::Tensor& num_rejected, int64_t max_model_len, at::Tensor& out_ids, at::Tensor& out_pos,
              at::Tensor& out_last, at::Tensor& out_qsl, at::Tensor& out_seq_lens) {
  using G = PrefillGeometry;
  const int64_t num_tokens = input_ids.size(0);
  const int64_t num_reqs = query_start_loc.size(0) - 1;
  const int64_t max_num_reqs = out_last.size(0);
  const int64_t programs = std::max((max_num_reqs + 1 + G::rows - 1) / G::rows,
                                    (num_tokens + num_reqs + G::rows * G::slots - 1) / (G::rows * G::slots));
  KernelArgs args;
  args.tensor(input_ids).tensor(positions).tensor(query_start_loc).tensor(seq_lens).tensor(idx_mapping);
  args.tensor(last_sampled).tensor(num_rejected);
  args.tensor(out_ids).tensor(out_pos).tensor(out_last).tensor(out_qsl).tensor(out_seq_lens);
  args.integer(num_tokens).integer(num_reqs).integer(std::max<int64_t>(last_sampled.size(0), 1));
  args.integer(max_num_reqs).integer(max_model_len);
  args.constexpr_(G::rows).constexpr_(G::slots).constexpr_(G::long_slots);
  launch_triton("prepare_prefill", input_ids.device(), args, G::num_warps, {programs, 1, 1});
}

using Runner = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&, at::Tensor&,
                        at::Tensor&, at::Tensor&, at::Tensor&);

template <Runner run>
void prepare_prefill_into(const at::Tensor& input_ids, const at::Tensor& positions,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          const at::Tensor& idx_mapping, const at::Tensor& last_sampled,
                          const at::Tensor& num_rejected, int64_t max_model_len, at::Tensor expanded_input_ids,
                          at::Tensor expanded_positions, at::Tensor last_token_indices,
                          at::Tensor expanded_query_start_loc, at::Tensor expanded_seq_lens) {
  constexpr const char* op = "prepare_prefill_into";
  check_inputs(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
               max_model_len);
  const int64_t num_reqs = query_start_loc.size(0) - 1;
  const int64_t total = input_ids.size(0) + num_reqs;
  const std::pair<const char*, const at::Tensor*> outs[] = {
      {"expanded_input_ids", &expanded_input_ids},
      {"expanded_positions", &expanded_positions},
      {"last_token_indices", &last_token_indices},
      {"expanded_query_start_loc", &expanded_query_start_loc},
      {"expanded_seq_lens", &expanded_seq_lens}};
  for (const auto& [name, t] : outs) {
    check_rank(op, name, *t, 1);
    check_device(op, name, *t, input_ids.device());
    check_unit_stride(op, name, *t);
  }
  check_int_dtype(op, "expanded_input_ids", expanded_input_ids);
  check_dtype(op, "expanded_positions", expanded_positions, at::kLong);
  check_dtype(op, "last_token_indices", last_token_indices, at::kLong);
  check_dtype(op, "expanded_query_start_loc", expanded_query_start_loc, at::kInt);
  check_dtype(op, "expanded_seq_lens", expanded_seq_lens, at::kInt);
  const int64_t max_num_reqs = last_token_indices.size(0);
  SPECDEC_CHECK(expanded_input_ids.size(0) >= total, op, ": argument 'expanded_input_ids' has ",
                expanded_input_ids.size(0), " entries, expected at least num_tokens + num_reqs = ", total);
  SPECDEC_CHECK(expanded_positions.size(0) >= total, op, ": argument 'expanded_positions' has ",
                expanded_positions.size(0), " entries, expected at least num_tokens + num_reqs = ", total);
  SPECDEC_CHECK(max_num_reqs >= num_reqs, op, ": argument 'last_token_indices' has ", max_num_reqs,
                " entries (max_num_reqs), expected at least num_reqs = ", num_reqs);
  check_size(op, "expanded_seq_lens", expanded_seq_lens, 0, max_num_reqs,
             "max_num_reqs, the length of last_token_indices");
  check_size(op, "expanded_query_start_loc", expanded_query_start_loc, 0, max_num_reqs + 1,
             "max_num_reqs + 1");
  run(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected, max_model_len,
      expanded_input_ids, expanded_positions, last_token_indices, expanded_query_start_loc, expanded_seq_lens);
}

template <Runner run>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_prefill(
    const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, const at::Tensor& idx_mapping, const at::Tensor& last_sampled,
    const at::Tensor& num_rejected, int64_t max_model_len, std::optional<int64_t> max_num_reqs) {
  check_inputs(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
               max_model_len);
  const int64_t num_reqs = query_start_loc.size(0) - 1;
  const int64_t padded_reqs = max_num_reqs.value_or(num_reqs);
  SPECDEC_CHECK(padded_reqs >= num_reqs, kOp, ": argument 'max_num_reqs' must be >= num_reqs = ", num_reqs,
                ", got ", padded_reqs);
  const int64_t total = input_ids.size(0) + num_reqs;
  const c10::Device device = input_ids.device();
  const c10::OptionalDeviceGuard guard(device.is_cuda() ? std::optional<c10::Device>(device) : std::nullopt);
  const auto new_vector = [&](int64_t size, at::ScalarType dtype) {
    return device.is_cuda() ? new_cuda_output({size}, dtype, device)
                            : at::empty({size}, input_ids.options().dtype(dtype));
  };
  at::Tensor ids = new_vector(total, input_ids.scalar_type());
  at::Tensor pos = new_vector(total, at::kLong);
  at::Tensor last = new_vector(padded_reqs, at::kLong);
  at::Tensor qsl = new_vector(padded_reqs + 1, at::kInt);
  at::Tensor seq = new_vector(padded_reqs, at::kInt);
  run(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected, max_model_len, ids,
      pos, last, qsl, seq);
  return {std::move(ids), std::move(pos), std::move(last), std::move(qsl), std::move(seq)};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("prepare_prefill", &prepare_prefill<run_cpu>);
  m.impl("prepare_prefill_into", &prepare_prefill_into<run_cpu>);
}

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("prepare_prefill", &prepare_prefill<run_cuda>);
  m.impl("prepare_prefill_into", &prepare_prefill_into<run_cuda>);
}

}  // namespace specdec
