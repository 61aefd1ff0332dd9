// Argument checks for the C++ kernels. Messages follow specdec_ops/ops/checks.py:
// op, argument name, what was expected; each raises a Python ValueError.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <type_traits>

namespace specdec {

// Error messages are assembled with std::to_string rather than through an
// ostream: on the H200 image, streaming a number from this library's own code
// into TORCH_CHECK's message crashed the process inside pytest.
namespace detail {
inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, c10::IntArrayRef sizes) {
  out += "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(sizes[i]);
  }
  out += "]";
}
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline void append(std::string& out, T value) {
  out += std::to_string(value);
}
}  // namespace detail

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (detail::append(out, args), ...);
  return out;
}

// TORCH_CHECK_VALUE (raises a Python ValueError) with a message built by message().
#define SPECDEC_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, ::specdec::message(__VA_ARGS__))

// The name Python users know a dtype by (torch.int64 -> "int64").
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "bool";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    default: return std::string(c10::toString(t));
  }
}

inline void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t ndim) {
  SPECDEC_CHECK(t.dim() == ndim, op, ": argument '", name, "' must be ", ndim, "-D, got shape ",
                t.sizes());
}

inline void check_int_dtype(const char* op, const char* name, const at::Tensor& t) {
  SPECDEC_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": argument '",
                name, "' must have dtype int32 or int64, got ", dtype_name(t.scalar_type()));
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  SPECDEC_CHECK(t.scalar_type() == dtype, op, ": argument '", name, "' must have dtype ",
                dtype_name(dtype), ", got ", dtype_name(t.scalar_type()));
}

inline void check_device(const char* op, const char* name, const at::Tensor& t, const c10::Device& device) {
  SPECDEC_CHECK(t.device() == device, op, ": argument '", name, "' is on ", t.device(), ", expected ", device,
                " like the other inputs");
}

inline void check_cpu(const char* op, const char* name, const at::Tensor& t) {
  check_device(op, name, t, c10::Device(c10::kCPU));
}

inline void check_unit_stride(const char* op, const char* name, const at::Tensor& t) {
  SPECDEC_CHECK(t.dim() == 0 || t.numel() <= 1 || t.stride(-1) == 1, op, ": argument '", name,
                "' must have a unit stride in its last dimension");
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                       int64_t expected, const char* meaning) {
  SPECDEC_CHECK(t.size(dim) == expected, op, ": argument '", name, "' has size ", t.size(dim),
                " in dimension ", dim, ", expected ", expected, " (", meaning, "); shape ",
                t.sizes());
}

// The CPU int32/int64 [B, k] draft token ids a verifier reads.
inline void check_draft_ids(const char* op, const at::Tensor& draft) {
  check_rank(op, "draft_token_ids", draft, 2);
  check_int_dtype(op, "draft_token_ids", draft);
  check_cpu(op, "draft_token_ids", draft);
  check_unit_stride(op, "draft_token_ids", draft);
}

struct RoundShape {
  int64_t batch;
  int64_t k;
  int64_t vocab;
};

// (B, k, V) of a rank-3 [B, k+1, V] target tensor, checked (k >= 1, V >= 1), and the draft ids checked against it.
inline RoundShape check_round_shape(const char* op, const char* target_name, const at::Tensor& target,
                                    const at::Tensor& draft) {
  const RoundShape shape{target.size(0), target.size(1) - 1, target.size(2)};
  SPECDEC_CHECK(shape.k >= 1, op, ": argument '", target_name,
                "' must have k+1 >= 2 positions in dimension 1, got shape ", target.sizes());
  SPECDEC_CHECK(shape.vocab >= 1, op, ": argument '", target_name, "' must have a vocabulary of V >= 1, got shape ",
                target.sizes());
  check_draft_ids(op, draft);
  const std::string rows = std::string("B, rows of ") + target_name;
  const std::string positions = std::string("k, ") + target_name + " has k+1 positions";
  check_size(op, "draft_token_ids", draft, 0, shape.batch, rows.c_str());
  check_size(op, "draft_token_ids", draft, 1, shape.k, positions.c_str());
  return shape;
}

// The float32 [n, V] CPU tensor a draft sampler writes its row distributions into (the .with_probs overloads).
inline void check_draft_probs_out(const char* op, const at::Tensor& probs, int64_t rows, int64_t vocab) {
  check_rank(op, "probs", probs, 2);
  check_dtype(op, "probs", probs, at::kFloat);
  check_cpu(op, "probs", probs);
  check_unit_stride(op, "probs", probs);
  check_size(op, "probs", probs, 0, rows, "n, rows of logits");
  check_size(op, "probs", probs, 1, vocab, "V, columns of logits");
}

// The int64 [3] (accepted, emitted, proposed) statistics of the .counted overloads.
inline void check_counters(const char* op, const at::Tensor& counters,
                           const c10::Device& device = c10::Device(c10::kCPU)) {
  check_rank(op, "counters", counters, 1);
  check_dtype(op, "counters", counters, at::kLong);
  check_device(op, "counters", counters, device);
  check_unit_stride(op, "counters", counters);
  check_size(op, "counters", counters, 0, 3, "accepted, emitted, proposed");
}

inline void add_counters(at::Tensor& counters, int64_t accepted, int64_t emitted, int64_t proposed) {
  int64_t* c = counters.data_ptr<int64_t>();
  c[0] += accepted;
  c[1] += emitted;
  c[2] += proposed;
}

// Writes v into element i of an int32/int64 tensor, narrowing to its dtype.
inline void store_int(at::Tensor& t, int64_t i, int64_t v) {
  if (t.scalar_type() == at::kInt) {
    t.data_ptr<int32_t>()[i] = static_cast<int32_t>(v);
  } else {
    t.data_ptr<int64_t>()[i] = v;
  }
}

// Reads the int32/int64 element at flat offset i from t's data pointer as int64
// (strided readers compute i from the strides).
inline int64_t load_int(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kInt ? static_cast<int64_t>(t.const_data_ptr<int32_t>()[i])
                                     : t.const_data_ptr<int64_t>()[i];
}

}  // namespace specdec
