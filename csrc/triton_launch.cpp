#include "triton_launch.h"

#include <Python.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>

#include <mutex>
#include <unordered_map>

#include "checks.h"

namespace specdec {
namespace {

// cuLaunchKernel's C signature (CUresult is an int enum; CUfunction and CUstream are pointers).
using LaunchKernelFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                               void**, void**);

LaunchKernelFn launch_kernel_fn() {
  static LaunchKernelFn fn = [] {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(driver != nullptr, "specdec_ops: cannot load the CUDA driver (libcuda.so.1)");
    auto symbol = reinterpret_cast<LaunchKernelFn>(dlsym(driver, "cuLaunchKernel"));
    TORCH_CHECK(symbol != nullptr, "specdec_ops: the CUDA driver has no cuLaunchKernel");
    return symbol;
  }();
  return fn;
}

struct LoadedKernel {
  void* function;
  unsigned shared_bytes;
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

// Asks the Python provider to compile and load one specialization.
LoadedKernel compile_with_python(const char* kernel, const std::vector<std::pair<int, std::string>>& signature,
                                 int num_warps) {
  PyGILState_STATE gil = PyGILState_Ensure();
  std::string error;
  LoadedKernel loaded{nullptr, 0};
  if (provider == nullptr) {
    error = "no Triton provider is registered (import specdec_ops with triton installed)";
  } else {
    PyObject* spec = PyTuple_New(static_cast<Py_ssize_t>(signature.size()));
    for (size_t i = 0; i < signature.size(); ++i) {
      const auto& [kind, text] = signature[i];
      // Tensors by dtype name; ints by a value of their width; constexprs by value.
      PyObject* item = kind == 0 ? PyUnicode_FromString(text.c_str()) : PyLong_FromLongLong(std::stoll(text));
      PyTuple_SET_ITEM(spec, static_cast<Py_ssize_t>(i), item);
    }
    PyObject* result = PyObject_CallFunction(provider, "sOi", kernel, spec, num_warps);
    Py_DECREF(spec);
    unsigned long long function = 0;
    unsigned int shared = 0;
    if (result == nullptr) {
      error = python_error();
    } else if (!PyArg_ParseTuple(result, "KI", &function, &shared)) {
      error = python_error();
    } else {
      loaded = {reinterpret_cast<void*>(function), shared};
    }
    Py_XDECREF(result);
  }
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
  // The specialization key: kernel, device, warps, then per argument its kind and dtype or constexpr value.
  std::string key = kernel;
  key += static_cast<char>(device.index());
  key += static_cast<char>(num_warps);
  for (int i = 0; i < args.count_; ++i) {
    key += static_cast<char>(args.kinds_[i]);
    if (args.kinds_[i] == KernelArgs::kPointer) key += static_cast<char>(args.dtypes_[i]);
    if (args.kinds_[i] == KernelArgs::kConstexpr) key.append(reinterpret_cast<const char*>(&args.values_[i]), 8);
  }
  LoadedKernel loaded{nullptr, 0};
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto found = cache.find(key);
    if (found != cache.end()) loaded = found->second;
  }
  if (loaded.function == nullptr) {
    // Tensors by dtype name; ints by a value of their width; constexprs by value.
    std::vector<std::pair<int, std::string>> signature;
    for (int i = 0; i < args.count_; ++i) {
      switch (args.kinds_[i]) {
        case KernelArgs::kPointer: signature.emplace_back(0, dtype_name(args.dtypes_[i])); break;
        case KernelArgs::kInt32: signature.emplace_back(1, "0"); break;
        case KernelArgs::kInt64: signature.emplace_back(1, std::to_string(int64_t{1} << 40)); break;
        case KernelArgs::kConstexpr: signature.emplace_back(1, std::to_string(args.values_[i])); break;
      }
    }
    loaded = compile_with_python(kernel, signature, num_warps);
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
  const int status = launch_kernel_fn()(loaded.function, static_cast<unsigned>(grid[0]),
                                        static_cast<unsigned>(grid[1]), static_cast<unsigned>(grid[2]),
                                        static_cast<unsigned>(32 * num_warps), 1, 1, loaded.shared_bytes, stream,
                                        params, nullptr);
  TORCH_CHECK(status == 0, message("specdec_ops: cuLaunchKernel failed for ", kernel, " with CUDA error ", status));
}

}  // namespace specdec

// Called from Python (specdec_ops/_launch.py) with the compile-and-load function.
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
