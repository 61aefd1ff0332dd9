// The eager calls of the C++-launched ops (prepare_prefill, prepare_prefill_into,
// create_output), for their Python wrappers.
//
// A call through torch.ops.specdec.* converts every argument to an IValue
// against the schema, calls the op boxed and converts the results back: on
// the H200's host that costs more than the launch. These entries read their
// arguments straight from Python and call the op through the dispatcher,
// unboxed, so every dispatch key (CPU, CUDA, Python modes, tracers) is still
// honoured. Calls that torch.ops would hand to __torch_function__ (a Tensor
// subclass, a torch function mode) or whose ints are not plain Python ints go
// to the wrapper's torch.ops path, registered as the entry's fallback.
// The wrappers call torch.ops directly while torch.compile traces them.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <tuple>

namespace specdec {
namespace {

using at::Tensor;

// The fallbacks (owned references) and the Python type of prepare_prefill's result, set by register_eager.
PyObject* prefill_fallback = nullptr;
PyObject* prefill_into_fallback = nullptr;
PyObject* create_output_fallback = nullptr;
PyTypeObject* prefill_result_type = nullptr;

// Whether torch.ops would pass these arguments to the dispatcher as they are: plain tensors (Parameter
// counts as one, as in torch) and no torch function mode.
bool plain_tensors(PyObject* const* args, Py_ssize_t begin, Py_ssize_t end) {
  for (Py_ssize_t i = begin; i < end; ++i) {
    if (!THPVariable_CheckExact(args[i])) return false;
  }
  return !at::impl::torch_function_mode_enabled();
}

// Reads a plain Python int that fits int64 (anything else takes the fallback, which reports it).
bool plain_int(PyObject* object, int64_t* value) {
  if (!PyLong_CheckExact(object)) return false;
  int overflow = 0;
  *value = PyLong_AsLongLongAndOverflow(object, &overflow);
  return overflow == 0;
}

const Tensor& tensor(PyObject* object) { return THPVariable_Unpack(object); }

// Checks the argument count, and that importing specdec_ops registered the entry's fallback.
bool ready(const char* name, PyObject* fallback, Py_ssize_t nargs, Py_ssize_t expected) {
  if (nargs != expected) {
    PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments but %zd were given", name, expected, nargs);
    return false;
  }
  if (fallback == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "specdec_ops: the eager entry of %s is not registered (import specdec_ops)",
                 name);
    return false;
  }
  return true;
}

// Lets other Python threads run during the op, as torch's own bindings do (the first launch of a kernel
// takes the GIL back to compile it).
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease() { PyEval_RestoreThread(state_); }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Signature>();
}

using PrefillResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using PrefillSignature = PrefillResult(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                       const Tensor&, const Tensor&, int64_t, std::optional<int64_t>);
// Mutable arguments by value, as the kernels take them (typed() checks the kernels' signature).
using PrefillIntoSignature = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, int64_t, Tensor, Tensor, Tensor, Tensor, Tensor);
using CreateOutputSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using CreateOutputCountedSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor);

}  // namespace
}  // namespace specdec

using namespace specdec;

extern "C" {

// register_eager(name, fallback, result_type=None): the fallback is the wrapper's torch.ops path, with the
// entry's positional arguments; prepare_prefill also takes the NamedTuple type of its result.
PyObject* specdec_register_eager(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 3 || !PyUnicode_Check(args[0]) || !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "register_eager(name: str, fallback: callable, result_type: type = None)");
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(args[0]);
  if (name == nullptr) return nullptr;
  PyObject** slot = std::strcmp(name, "prepare_prefill") == 0        ? &prefill_fallback
                    : std::strcmp(name, "prepare_prefill_into") == 0 ? &prefill_into_fallback
                    : std::strcmp(name, "create_output") == 0        ? &create_output_fallback
                                                                     : nullptr;
  if (slot == nullptr) {
    PyErr_Format(PyExc_ValueError, "register_eager: no eager entry named '%s'", name);
    return nullptr;
  }
  if (slot == &prefill_fallback) {
    // The result is built as an instance of this tuple subclass (a NamedTuple without extra fields).
    if (nargs != 3 || !PyType_Check(args[2]) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(args[2]), &PyTuple_Type)) {
      PyErr_SetString(PyExc_TypeError, "register_eager: prepare_prefill needs its result type, a tuple subclass");
      return nullptr;
    }
    Py_INCREF(args[2]);
    Py_XSETREF(prefill_result_type, reinterpret_cast<PyTypeObject*>(args[2]));
  }
  Py_INCREF(args[1]);
  Py_XSETREF(*slot, args[1]);
  Py_RETURN_NONE;
}

// prepare_prefill(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
//                 max_model_len, max_num_reqs) -> PrefillInputs
PyObject* specdec_eager_prepare_prefill(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!ready("prepare_prefill", prefill_fallback, nargs, 9)) return nullptr;
  int64_t max_model_len = 0;
  int64_t padded_reqs = 0;
  const bool default_padding = args[8] == Py_None;
  if (!plain_tensors(args, 0, 7) || !plain_int(args[7], &max_model_len) ||
      !(default_padding || plain_int(args[8], &padded_reqs))) {
    return PyObject_Vectorcall(prefill_fallback, args, nargs, nullptr);
  }
  static const auto op = find_op<PrefillSignature>("specdec::prepare_prefill", "");
  PrefillResult result;
  {
    GilRelease no_gil;
    result = op.call(tensor(args[0]), tensor(args[1]), tensor(args[2]), tensor(args[3]), tensor(args[4]),
                     tensor(args[5]), tensor(args[6]), max_model_len,
                     default_padding ? std::nullopt : std::optional<int64_t>(padded_reqs));
  }
  PyObject* outputs = prefill_result_type->tp_alloc(prefill_result_type, 5);
  if (outputs == nullptr) return nullptr;
  PyTuple_SET_ITEM(outputs, 0, THPVariable_Wrap(std::move(std::get<0>(result))));
  PyTuple_SET_ITEM(outputs, 1, THPVariable_Wrap(std::move(std::get<1>(result))));
  PyTuple_SET_ITEM(outputs, 2, THPVariable_Wrap(std::move(std::get<2>(result))));
  PyTuple_SET_ITEM(outputs, 3, THPVariable_Wrap(std::move(std::get<3>(result))));
  PyTuple_SET_ITEM(outputs, 4, THPVariable_Wrap(std::move(std::get<4>(result))));
  for (Py_ssize_t i = 0; i < 5; ++i) {
    if (PyTuple_GET_ITEM(outputs, i) == nullptr) {
      Py_DECREF(outputs);
      return nullptr;
    }
  }
  return outputs;
  END_HANDLE_TH_ERRORS
}

// prepare_prefill_into(7 inputs, max_model_len, 5 output buffers) -> None
PyObject* specdec_eager_prepare_prefill_into(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!ready("prepare_prefill_into", prefill_into_fallback, nargs, 13)) return nullptr;
  int64_t max_model_len = 0;
  if (!plain_tensors(args, 0, 7) || !plain_int(args[7], &max_model_len) || !plain_tensors(args, 8, 13)) {
    return PyObject_Vectorcall(prefill_into_fallback, args, nargs, nullptr);
  }
  static const auto op = find_op<PrefillIntoSignature>("specdec::prepare_prefill_into", "");
  {
    GilRelease no_gil;
    op.call(tensor(args[0]), tensor(args[1]), tensor(args[2]), tensor(args[3]), tensor(args[4]), tensor(args[5]),
            tensor(args[6]), max_model_len, tensor(args[8]), tensor(args[9]), tensor(args[10]), tensor(args[11]),
            tensor(args[12]));
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// create_output(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters) -> Tensor; the
// .counted overload when counters is not None.
PyObject* specdec_eager_create_output(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!ready("create_output", create_output_fallback, nargs, 5)) return nullptr;
  const bool counted = args[4] != Py_None;
  if (!plain_tensors(args, 0, counted ? 5 : 4)) {
    return PyObject_Vectorcall(create_output_fallback, args, nargs, nullptr);
  }
  Tensor result;
  if (counted) {
    static const auto op = find_op<CreateOutputCountedSignature>("specdec::create_output", "counted");
    GilRelease no_gil;
    result = op.call(tensor(args[0]), tensor(args[1]), tensor(args[2]), tensor(args[3]), tensor(args[4]));
  } else {
    static const auto op = find_op<CreateOutputSignature>("specdec::create_output", "");
    GilRelease no_gil;
    result = op.call(tensor(args[0]), tensor(args[1]), tensor(args[2]), tensor(args[3]));
  }
  return THPVariable_Wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

}  // extern "C"

// These ops take and return integer tensors only, which cannot require grad, so autograd has nothing to do:
// skipping its boxed fallback keeps the call unboxed from the entry to the kernel.
TORCH_LIBRARY_IMPL(specdec, Autograd, m) {
  m.impl("prepare_prefill", torch::CppFunction::makeFallthrough());
  m.impl("prepare_prefill_into", torch::CppFunction::makeFallthrough());
  m.impl("create_output", torch::CppFunction::makeFallthrough());
  m.impl("create_output.counted", torch::CppFunction::makeFallthrough());
}
