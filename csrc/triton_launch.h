// Launches Triton-compiled kernels from C++, for the ops whose whole CUDA
// path (checks, allocation, launch) is C++ so an eager call costs one dispatch
// and one cuLaunchKernel, with no Python in between.
//
// The first launch of a kernel specialization (argument dtypes, int widths,
// constexprs, warps) asks Python to compile it with Triton and load it
// (specdec_ops/kernels/launch.py registers that provider); later launches reuse the
// loaded function. The driver is reached through dlopen, so this file builds
// against a CPU-only torch as well.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <string>
#include <vector>

namespace specdec {

// Launch geometry of the kernels launched from C++ (tuned on the H200): the
// entries of specdec_ops/kernels/geometry.py, which tests/test_geometry.py
// checks against _C._launch_geometry().
struct PrefillGeometry {
  static constexpr int rows = 16;          // requests per program
  static constexpr int slots = 16;         // the tile's first column: all query_len + 1 slots of a decode round
                                           // with k up to 14 (8 slots made k = 8 take the path below)
  static constexpr int long_slots = 1024;  // the rest of a longer query, one request at a time, in steps of this
                                           // many slots
  static constexpr int num_warps = 4;
};
struct OutputGeometry {
  static constexpr int block_rows = 16;  // rows per program: small tiles, many programs
  static constexpr int num_warps = 4;
};

// One runtime argument of a Triton kernel: a tensor's data pointer or an int
// (passed as i32 when it fits, as Triton does, else as i64).
class KernelArgs {
 public:
  KernelArgs& tensor(const at::Tensor& t);
  KernelArgs& integer(int64_t v);
  KernelArgs& constexpr_(int64_t v);  // a tl.constexpr parameter (compiled in, not passed)

 private:
  friend void launch_triton(const char*, const at::Device&, const KernelArgs&, int, std::array<int64_t, 3>);
  enum Kind : int8_t { kPointer, kInt32, kInt64, kConstexpr };
  static constexpr int kMaxArgs = 32;
  int count_ = 0;
  Kind kinds_[kMaxArgs];
  at::ScalarType dtypes_[kMaxArgs];  // tensors only
  int64_t values_[kMaxArgs];         // pointer bits, int value or constexpr value
};

// Launches `kernel` (a name registered on the Python side) on the current
// stream of `device` with the given grid and warps.
void launch_triton(const char* kernel, const at::Device& device, const KernelArgs& args, int num_warps,
                   std::array<int64_t, 3> grid);

// An uninitialized contiguous CUDA tensor, from the allocator at::empty uses,
// without at::empty's two dispatcher hops (BackendSelect, then the CUDA
// empty): prepare_prefill allocates five outputs per eager call. Unlike
// at::empty it does not fill the memory under torch's deterministic mode
// (the kernels write every element) and leaves the device guard to the
// caller, who must hold one for `device` (the allocator serves the current
// device).
at::Tensor new_cuda_output(c10::IntArrayRef sizes, at::ScalarType dtype, const at::Device& device);

}  // namespace specdec
