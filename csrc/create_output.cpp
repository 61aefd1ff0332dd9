// CPU kernel and C++ CUDA launcher of specdec::create_output (and its
// .counted overload). The contract is in specdec_ops/ops/output.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "triton_launch.h"

namespace specdec {
namespace {

constexpr const char* kOp = "create_output";

bool is_index_dtype(at::ScalarType t) {
  return t == at::kBool || t == at::kByte || t == at::kChar || t == at::kShort || t == at::kInt ||
         t == at::kLong;
}

// Reads element i of a tensor of any integer or bool dtype as int64.
int64_t load_any_int(const at::Tensor& t, int64_t i) {
  switch (t.scalar_type()) {
    case at::kBool: return t.const_data_ptr<bool>()[i];
    case at::kByte: return t.const_data_ptr<uint8_t>()[i];
    case at::kChar: return t.const_data_ptr<int8_t>()[i];
    case at::kShort: return t.const_data_ptr<int16_t>()[i];
    case at::kInt: return t.const_data_ptr<int32_t>()[i];
    default: return t.const_data_ptr<int64_t>()[i];
  }
}

void check_inputs(const at::Tensor& accepted_in, const at::Tensor& substitute_in, const at::Tensor& draft_in,
                  const at::Tensor& bonus_in, const at::Tensor* counters) {
  check_rank(kOp, "accepted", accepted_in, 2);
  check_rank(kOp, "substitute_token_ids", substitute_in, 2);
  check_rank(kOp, "draft_token_ids", draft_in, 2);
  SPECDEC_CHECK(bonus_in.dim() == 1 || (bonus_in.dim() == 2 && bonus_in.size(1) == 1), kOp,
                ": argument 'bonus_token_ids' must have shape [B, 1] or [B], got shape ", bonus_in.sizes());
  SPECDEC_CHECK(is_index_dtype(accepted_in.scalar_type()), kOp,
                ": argument 'accepted' must have dtype bool or an integer dtype, got ",
                dtype_name(accepted_in.scalar_type()));
  check_int_dtype(kOp, "substitute_token_ids", substitute_in);
  check_int_dtype(kOp, "draft_token_ids", draft_in);
  check_int_dtype(kOp, "bonus_token_ids", bonus_in);
  const std::pair<const char*, const at::Tensor*> args[] = {{"accepted", &accepted_in},
                                                            {"substitute_token_ids", &substitute_in},
                                                            {"draft_token_ids", &draft_in},
                                                            {"bonus_token_ids", &bonus_in}};
  for (const auto& [name, t] : args) check_device(kOp, name, *t, draft_in.device());
  // The kernels read the bonus by its row stride; the [B, k] inputs need a unit stride along k.
  check_unit_stride(kOp, "accepted", accepted_in);
  check_unit_stride(kOp, "substitute_token_ids", substitute_in);
  check_unit_stride(kOp, "draft_token_ids", draft_in);
  const int64_t batch = draft_in.size(0);
  const int64_t k = draft_in.size(1);
  SPECDEC_CHECK(k >= 1, kOp, ": argument 'draft_token_ids' must have k >= 1 columns, got shape ",
                draft_in.sizes());
  check_size(kOp, "accepted", accepted_in, 0, batch, "B, rows of draft_token_ids");
  check_size(kOp, "accepted", accepted_in, 1, k, "k, columns of draft_token_ids");
  check_size(kOp, "substitute_token_ids", substitute_in, 0, batch, "B, rows of draft_token_ids");
  check_size(kOp, "substitute_token_ids", substitute_in, 1, k, "k, columns of draft_token_ids");
  check_size(kOp, "bonus_token_ids", bonus_in, 0, batch, "B, rows of draft_token_ids");
  if (counters != nullptr) check_counters(kOp, *counters, draft_in.device());
}

at::Tensor create_output_impl(const at::Tensor& accepted_in, const at::Tensor& substitute_in,
                              const at::Tensor& draft_in, const at::Tensor& bonus_in,
                              at::Tensor* counters) {
  check_inputs(accepted_in, substitute_in, draft_in, bonus_in, counters);
  const int64_t batch = draft_in.size(0);
  const int64_t k = draft_in.size(1);

  const at::Tensor accepted = accepted_in.contiguous();
  const at::Tensor substitute = substitute_in.contiguous();
  const at::Tensor draft = draft_in.contiguous();
  const at::Tensor bonus = bonus_in.contiguous();
  at::Tensor out = at::empty({batch, k + 1}, draft.options());

  int64_t num_accepted = 0;
  int64_t num_emitted = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t first_rejected = k;
    for (int64_t j = 0; j < k; ++j) {
      const bool acc = load_any_int(accepted, b * k + j) != 0;
      num_accepted += acc;
      if (!acc && first_rejected == k) first_rejected = j;
    }
    for (int64_t j = 0; j < k; ++j) {
      int64_t v = -1;
      if (j < first_rejected) {
        v = load_int(draft, b * k + j);
      } else if (j == first_rejected) {
        v = load_int(substitute, b * k + j);
      }
      store_int(out, b * (k + 1) + j, v);
      num_emitted += v != -1;
    }
    // As in the seed: the bonus goes out only if the last draft column holds
    // an accepted token (an accepted draft id of -1 emits no bonus).
    const bool all_accepted = first_rejected == k && load_int(draft, b * k + k - 1) != -1;
    const int64_t bonus_val = all_accepted ? load_int(bonus, b) : -1;
    store_int(out, b * (k + 1) + k, bonus_val);
    num_emitted += bonus_val != -1;
  }
  if (counters != nullptr) add_counters(*counters, num_accepted, num_emitted, batch * k);
  return out;
}

at::Tensor create_output_cpu(const at::Tensor& accepted, const at::Tensor& substitute_token_ids,
                             const at::Tensor& draft_token_ids, const at::Tensor& bonus_token_ids) {
  return create_output_impl(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, nullptr);
}

at::Tensor create_output_counted_cpu(const at::Tensor& accepted, const at::Tensor& substitute_token_ids,
                                     const at::Tensor& draft_token_ids, const at::Tensor& bonus_token_ids,
                                     at::Tensor counters) {
  return create_output_impl(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, &counters);
}

// The Triton kernel (specdec_ops/kernels/output.py), launched from C++.
at::Tensor create_output_cuda_impl(const at::Tensor& accepted, const at::Tensor& substitute,
                                   const at::Tensor& draft, const at::Tensor& bonus, const at::Tensor* counters) {
  using G = OutputGeometry;
  check_inputs(accepted, substitute, draft, bonus, counters);
  const int64_t batch = draft.size(0);
  const int64_t k = draft.size(1);
  const c10::DeviceGuard guard(draft.device());
  at::Tensor out = new_cuda_output({batch, k + 1}, draft.scalar_type(), draft.device());
  if (batch == 0) return out;
  int64_t block_cols = 1;
  while (block_cols < k + 1) block_cols *= 2;
  KernelArgs args;
  args.tensor(accepted).tensor(substitute).tensor(draft).tensor(bonus).tensor(out);
  args.tensor(counters != nullptr ? *counters : out);
  args.integer(batch).integer(k);
  args.integer(accepted.stride(0)).integer(substitute.stride(0)).integer(draft.stride(0)).integer(bonus.stride(0));
  args.constexpr_(G::block_rows).constexpr_(block_cols).constexpr_(counters != nullptr);
  launch_triton("create_output", draft.device(), args, G::num_warps, {(batch + G::block_rows - 1) / G::block_rows, 1, 1});
  return out;
}

at::Tensor create_output_cuda(const at::Tensor& accepted, const at::Tensor& substitute_token_ids,
                              const at::Tensor& draft_token_ids, const at::Tensor& bonus_token_ids) {
  return create_output_cuda_impl(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, nullptr);
}

at::Tensor create_output_counted_cuda(const at::Tensor& accepted, const at::Tensor& substitute_token_ids,
                                      const at::Tensor& draft_token_ids, const at::Tensor& bonus_token_ids,
                                      at::Tensor counters) {
  return create_output_cuda_impl(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, &counters);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("create_output", &create_output_cpu);
  m.impl("create_output.counted", &create_output_counted_cpu);
}

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("create_output", &create_output_cuda);
  m.impl("create_output.counted", &create_output_counted_cuda);
}

}  // namespace specdec
