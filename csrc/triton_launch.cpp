#include "triton_launch.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <Python.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>

#include <mutex>
#include <unordered_map>

#include "checks.h"

namespace specdec {
namespace {

// The few driver entry points used, with their C signatures (CUresult is an int enum; CUfunction, CUstream and
// CUcontext are pointers; CUdevice is an int).
struct Driver {
  int (*launch_kernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                       void**);
  int (*ctx_get_current)(void**);
  int (*ctx_set_current)(void*);
  int (*device_get)(int*, int);
  int (*primary_ctx_retain)(void**, int);
};

const Driver& driver() {
  static const Driver loaded = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(library != nullptr, "specdec_ops: cannot load the CUDA driver (libcuda.so.1)");
    auto symbol = [library](const char* name) {
      void* address = dlsym(library, name);
      TORCH_CHECK(address != nullptr, message("specdec_ops: the CUDA driver has no ", name));
      return address;
    };
    Driver d;
    d.launch_kernel = reinterpret_cast<decltype(d.launch_kernel)>(symbol("cuLaunchKernel"));
    d.ctx_get_current = reinterpret_cast<decltype(d.ctx_get_current)>(symbol("cuCtxGetCurrent"));
    d.ctx_set_current = reinterpret_cast<decltype(d.ctx_set_current)>(symbol("cuCtxSetCurrent"));
    d.device_get = reinterpret_cast<decltype(d.device_get)>(symbol("cuDeviceGet"));
    d.primary_ctx_retain = reinterpret_cast<decltype(d.primary_ctx_retain)>(symbol("cuDevicePrimaryCtxRetain"));
    return d;
  }();
  return loaded;
}

// A thread that has not used CUDA yet has no current context, and the device
// guard does not set one when the device index is already the current one;
// the driver API needs it, so bind the device's primary context (the one torch
// and Triton use).
void ensure_context(int device_index) {
  void* context = nullptr;
  if (driver().ctx_get_current(&context) == 0 && context != nullptr) return;
  int device = 0;
  int status = driver().device_get(&device, device_index);
  if (status == 0) status = driver().primary_ctx_retain(&context, device);
  if (status == 0) status = driver().ctx_set_current(context);
  TORCH_CHECK(status == 0, message("specdec_ops: cannot make the CUDA context of device ", device_index,
                                   " current (CUDA error ", status, ")"));
}

struct LoadedKernel {
  void* function;
  unsigned shared_bytes;
  int num_warps;  // as compiled (Triton may change the requested count)
};

std::mutex cache_mutex;
std::unordered_map<std::string, LoadedKernel> cache;
PyObject* provider = nullptr;  // set by _set_triton_provider; owned reference

std::string python_error() {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  std::string text = "unknown error";
  if (value != nullptr) {
    PyObject* str = PyObject_Str(value);
    if (str != nullptr) {
      const char* utf8 = PyUnicode_AsUTF8(str);
      if (utf8 != nullptr) text = utf8;
      Py_DECREF(str);
    }
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  PyErr_Clear();
  return text;
}

// Asks the Python provider to compile and load one specialization. Each
// signature entry is (is_int, value): a torch dtype name for a tensor, else an
// int (0 or 2**40 for an i32 or i64 argument, the value of a constexpr).
LoadedKernel compile_with_python(const char* kernel, const std::vector<std::pair<bool, int64_t>>& signature,
                                 const std::vector<std::string>& dtype_names, int num_warps) {
  TORCH_CHECK(Py_IsInitialized(), "specdec_ops: the CUDA kernels of prepare_prefill and create_output compile "
                                  "their Triton kernels through Python, which is not running in this process");
  PyGILState_STATE gil = PyGILState_Ensure();
  std::string error;
  LoadedKernel loaded{nullptr, 0, 0};
  PyObject* spec = nullptr;
  PyObject* result = nullptr;
  if (provider == nullptr) {
    error = "no Triton provider is registered (import specdec_ops with triton installed)";
  } else if ((spec = PyTuple_New(static_cast<Py_ssize_t>(signature.size()))) == nullptr) {
    error = python_error();
  } else {
    for (size_t i = 0; i < signature.size() && error.empty(); ++i) {
      const auto& [is_int, value] = signature[i];
      PyObject* item = is_int ? PyLong_FromLongLong(value) : PyUnicode_FromString(dtype_names[i].c_str());
      if (item == nullptr) error = python_error();
      else PyTuple_SET_ITEM(spec, static_cast<Py_ssize_t>(i), item);
    }
    if (error.empty()) {
      result = PyObject_CallFunction(provider, "sOi", kernel, spec, num_warps);
      unsigned long long function = 0;
      unsigned int shared = 0;
      int warps = 0;
      if (result == nullptr || !PyArg_ParseTuple(result, "KIi", &function, &shared, &warps)) {
        error = python_error();
      } else {
        loaded = {reinterpret_cast<void*>(function), shared, warps};
      }
    }
  }
  Py_XDECREF(result);
  Py_XDECREF(spec);
  PyGILState_Release(gil);
  TORCH_CHECK(error.empty(), message("specdec_ops: compiling Triton kernel ", kernel, " failed: ", error));
  return loaded;
}

}  // namespace

KernelArgs& KernelArgs::tensor(const at::Tensor& t) {
  TORCH_CHECK(count_ < kMaxArgs, "specdec_ops: too many kernel arguments");
  kinds_[count_] = kPointer;
  dtypes_[count_] = t.scalar_type();
  values_[count_++] = reinterpret_cast<int64_t>(t.data_ptr());
  return *this;
}

KernelArgs& KernelArgs::integer(int64_t v) {
  TORCH_CHECK(count_ < kMaxArgs, "specdec_ops: too many kernel arguments");
  kinds_[count_] = v >= INT32_MIN && v <= INT32_MAX ? kInt32 : kInt64;
  values_[count_++] = v;
  return *this;
}

KernelArgs& KernelArgs::constexpr_(int64_t v) {
  TORCH_CHECK(count_ < kMaxArgs, "specdec_ops: too many kernel arguments");
  kinds_[count_] = kConstexpr;
  values_[count_++] = v;
  return *this;
}

void launch_triton(const char* kernel, const at::Device& device, const KernelArgs& args, int num_warps,
                   std::array<int64_t, 3> grid) {
  c10::DeviceGuard guard(device);
  ensure_context(device.index());
  // The specialization key: kernel name, device, warps, then per argument its kind and dtype or constexpr value.
  std::string key = kernel;
  key += '\0';
  key += static_cast<char>(device.index());
  key += static_cast<char>(num_warps);
  for (int i = 0; i < args.count_; ++i) {
    key += static_cast<char>(args.kinds_[i]);
    if (args.kinds_[i] == KernelArgs::kPointer) key += static_cast<char>(args.dtypes_[i]);
    if (args.kinds_[i] == KernelArgs::kConstexpr) key.append(reinterpret_cast<const char*>(&args.values_[i]), 8);
  }
  LoadedKernel loaded{nullptr, 0, 0};
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto found = cache.find(key);
    if (found != cache.end()) loaded = found->second;
  }
  if (loaded.function == nullptr) {
    std::vector<std::pair<bool, int64_t>> signature;
    std::vector<std::string> dtype_names;
    for (int i = 0; i < args.count_; ++i) {
      const auto kind = args.kinds_[i];
      signature.emplace_back(kind != KernelArgs::kPointer,
                             kind == KernelArgs::kInt64 ? int64_t{1} << 40
                                                        : (kind == KernelArgs::kConstexpr ? args.values_[i] : 0));
      dtype_names.push_back(kind == KernelArgs::kPointer ? dtype_name(args.dtypes_[i]) : "");
    }
    loaded = compile_with_python(kernel, signature, dtype_names, num_warps);
    std::lock_guard<std::mutex> lock(cache_mutex);
    cache.emplace(key, loaded);
  }

  // Parameters: the runtime args in order (an i32 parameter reads the low 4 bytes of its little-endian slot),
  // then null pointers for the trailing scratch parameters Triton appends (the provider checks that the kernel
  // needs no scratch memory); the driver ignores entries past the kernel's parameter count.
  constexpr int kTrailingNulls = 4;
  int64_t storage[KernelArgs::kMaxArgs + kTrailingNulls];
  void* params[KernelArgs::kMaxArgs + kTrailingNulls];
  int num_params = 0;
  for (int i = 0; i < args.count_; ++i) {
    if (args.kinds_[i] == KernelArgs::kConstexpr) continue;
    storage[num_params] = args.values_[i];
    params[num_params] = &storage[num_params];
    ++num_params;
  }
  for (int i = 0; i < kTrailingNulls; ++i, ++num_params) {
    storage[num_params] = 0;
    params[num_params] = &storage[num_params];
  }

  void* stream = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device).native_handle();
  const int status = driver().launch_kernel(
      loaded.function, static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
      static_cast<unsigned>(grid[2]), static_cast<unsigned>(32 * loaded.num_warps), 1, 1, loaded.shared_bytes,
      stream, params, nullptr);
  TORCH_CHECK(status == 0, message("specdec_ops: cuLaunchKernel failed for ", kernel, " with CUDA error ", status));
}

at::Tensor new_cuda_output(c10::IntArrayRef sizes, at::ScalarType dtype, const at::Device& device) {
  // at::empty's CUDA allocator: torch's caching allocator, or one a user installed before CUDA started (it cannot
  // change after that). Read once from a tensor at::empty made, so both always agree.
  static c10::Allocator* const allocator =
      at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device)).storage().allocator();
  if (allocator == nullptr) return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  return at::detail::empty_generic(sizes, allocator, c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype,
                                   std::nullopt);
}

}  // namespace specdec

// Called from Python (specdec_ops/kernels/launch.py) with the compile-and-load function.
extern "C" PyObject* specdec_set_triton_provider(PyObject* /*self*/, PyObject* fn) {
  Py_XINCREF(fn);
  Py_XDECREF(specdec::provider);
  specdec::provider = fn;
  Py_RETURN_NONE;
}

extern "C" PyObject* specdec_launch_geometry(PyObject* /*self*/, PyObject* /*unused*/) {
  using specdec::OutputGeometry;
  using specdec::PrefillGeometry;
  return Py_BuildValue("{s:{s:i,s:i,s:i,s:i},s:{s:i,s:i}}", "prepare_prefill", "rows", PrefillGeometry::rows,
                       "slots", PrefillGeometry::slots, "long_slots", PrefillGeometry::long_slots, "num_warps",
                       PrefillGeometry::num_warps, "create_output", "block_rows", OutputGeometry::block_rows,
                       "num_warps", OutputGeometry::num_warps);
}
