// The eager calls of the C++-launched ops (prepare_prefill, prepare_prefill_into,
// create_output), for their Python wrappers.
//
// A call through torch.ops.specdec.* converts every argument to an IValue
// against the schema, calls the op boxed and converts the results back
// (benchmarks/RESULTS.md times both paths on the H200). These entries read their
// arguments straight from Python and call the op through the dispatcher,
// unboxed, so every dispatch key (CPU, CUDA, Python modes, tracers) is still
// honoured. Calls that torch.ops would hand to __torch_function__ (a Tensor
// subclass, a torch function mode) or whose ints are not plain Python ints go
// to the wrapper's torch.ops path, registered as the entry's fallback.
// The wrappers call torch.ops directly while torch.compile traces them. Any
// torch function mode sends the call to the fallback, torch.set_default_device's
// included, so under one the wrappers cost what a torch.ops call costs.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/object_ptr.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <optional>
#include <tuple>

namespace specdec {
namespace {

using at::Tensor;

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

// Set by register_eager, when specdec_ops imports: each entry's fallback (an owned reference) and op handles;
// prepare_prefill's also has the Python type of its result.
struct PrefillEntry {
  PyObject* fallback = nullptr;
  PyTypeObject* result_type = nullptr;
  std::optional<c10::TypedOperatorHandle<PrefillSignature>> op;
} prefill_entry;
struct PrefillIntoEntry {
  PyObject* fallback = nullptr;
  std::optional<c10::TypedOperatorHandle<PrefillIntoSignature>> op;
} prefill_into_entry;
struct CreateOutputEntry {
  PyObject* fallback = nullptr;
  std::optional<c10::TypedOperatorHandle<CreateOutputSignature>> op;
  std::optional<c10::TypedOperatorHandle<CreateOutputCountedSignature>> counted_op;
} create_output_entry;

// Whether torch.ops would hand these arguments to the dispatcher as they are: exact tensors (Parameter counts as
// one, as in torch), which have no __torch_function__ of their own. A torch function mode is checked apart.
bool exact_tensors(PyObject* const* args, Py_ssize_t begin, Py_ssize_t end) {
  for (Py_ssize_t i = begin; i < end; ++i) {
    if (!THPVariable_CheckExact(args[i])) return false;
  }
  return true;
}

// Reads a plain Python int that fits int64 (anything else takes the fallback, which reports it).
bool plain_int(PyObject* object, int64_t* value) {
  if (!PyLong_CheckExact(object)) return false;
  int overflow = 0;
  *value = PyLong_AsLongLongAndOverflow(object, &overflow);
  return overflow == 0;
}

const Tensor& unpack(PyObject* object) { return THPVariable_Unpack(object); }

// Checks the argument count, and that importing specdec_ops registered the entry.
bool check_call(const char* name, PyObject* fallback, Py_ssize_t nargs, Py_ssize_t expected) {
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

}  // namespace
}  // namespace specdec

using namespace specdec;

extern "C" {

// register_eager(name, fallback, result_type=None): the fallback is the wrapper's torch.ops path, with the
// entry's positional arguments; prepare_prefill also takes the NamedTuple type of its result.
PyObject* specdec_register_eager(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 2 || nargs > 3 || !PyUnicode_Check(args[0]) || !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "register_eager(name: str, fallback: callable, result_type: type = None)");
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(args[0]);
  if (name == nullptr) return nullptr;
  const bool is_prefill = std::strcmp(name, "prepare_prefill") == 0;
  PyObject** fallback = is_prefill                                     ? &prefill_entry.fallback
                        : std::strcmp(name, "prepare_prefill_into") == 0 ? &prefill_into_entry.fallback
                        : std::strcmp(name, "create_output") == 0        ? &create_output_entry.fallback
                                                                         : nullptr;
  if (fallback == nullptr) {
    PyErr_Format(PyExc_ValueError, "register_eager: no eager entry named '%s'", name);
    return nullptr;
  }
  // prepare_prefill's result is built as an instance of this tuple subclass (a NamedTuple); no other entry has one.
  const bool type_ok = is_prefill ? nargs == 3 && PyType_Check(args[2]) &&
                                        PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(args[2]), &PyTuple_Type)
                                  : nargs == 2;
  if (!type_ok) {
    PyErr_Format(PyExc_TypeError, "register_eager: '%s' %s", name,
                 is_prefill ? "needs its result type, a tuple subclass" : "takes no result type");
    return nullptr;
  }
  // Looking the ops up here makes a signature mismatch fail at import rather than at the first call.
  if (is_prefill) {
    prefill_entry.op = find_op<PrefillSignature>("specdec::prepare_prefill", "");
    Py_INCREF(args[2]);
    Py_XSETREF(prefill_entry.result_type, reinterpret_cast<PyTypeObject*>(args[2]));
  } else if (fallback == &prefill_into_entry.fallback) {
    prefill_into_entry.op = find_op<PrefillIntoSignature>("specdec::prepare_prefill_into", "");
  } else {
    create_output_entry.op = find_op<CreateOutputSignature>("specdec::create_output", "");
    create_output_entry.counted_op = find_op<CreateOutputCountedSignature>("specdec::create_output", "counted");
  }
  Py_INCREF(args[1]);
  Py_XSETREF(*fallback, args[1]);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// prepare_prefill(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
//                 max_model_len, max_num_reqs) -> PrefillInputs
PyObject* specdec_eager_prepare_prefill(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const PrefillEntry& entry = prefill_entry;
  if (!check_call("prepare_prefill", entry.fallback, nargs, 9)) return nullptr;
  int64_t max_model_len = 0;
  int64_t max_num_reqs = 0;
  const bool default_max_num_reqs = args[8] == Py_None;
  if (!exact_tensors(args, 0, 7) || at::impl::torch_function_mode_enabled() ||
      !plain_int(args[7], &max_model_len) || !(default_max_num_reqs || plain_int(args[8], &max_num_reqs))) {
    return PyObject_Vectorcall(entry.fallback, args, nargs, nullptr);
  }
  PrefillResult result;
  {
    GilRelease no_gil;
    result = entry.op->call(unpack(args[0]), unpack(args[1]), unpack(args[2]), unpack(args[3]), unpack(args[4]),
                            unpack(args[5]), unpack(args[6]), max_model_len,
                            default_max_num_reqs ? std::nullopt : std::optional<int64_t>(max_num_reqs));
  }
  THPObjectPtr outputs(PyTuple_New(5));
  if (!outputs) return nullptr;
  PyTuple_SET_ITEM(outputs.get(), 0, THPVariable_Wrap(std::move(std::get<0>(result))));
  PyTuple_SET_ITEM(outputs.get(), 1, THPVariable_Wrap(std::move(std::get<1>(result))));
  PyTuple_SET_ITEM(outputs.get(), 2, THPVariable_Wrap(std::move(std::get<2>(result))));
  PyTuple_SET_ITEM(outputs.get(), 3, THPVariable_Wrap(std::move(std::get<3>(result))));
  PyTuple_SET_ITEM(outputs.get(), 4, THPVariable_Wrap(std::move(std::get<4>(result))));
  for (Py_ssize_t i = 0; i < 5; ++i) {
    if (PyTuple_GET_ITEM(outputs.get(), i) == nullptr) return nullptr;
  }
  // tuple.__new__(PrefillInputs, outputs): the supported way to make a tuple subclass's instance.
  THPObjectPtr new_args(PyTuple_Pack(1, outputs.get()));
  if (!new_args) return nullptr;
  return PyTuple_Type.tp_new(entry.result_type, new_args.get(), nullptr);
  END_HANDLE_TH_ERRORS
}

// prepare_prefill_into(7 inputs, max_model_len, 5 output buffers) -> None
PyObject* specdec_eager_prepare_prefill_into(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const PrefillIntoEntry& entry = prefill_into_entry;
  if (!check_call("prepare_prefill_into", entry.fallback, nargs, 13)) return nullptr;
  int64_t max_model_len = 0;
  if (!exact_tensors(args, 0, 7) || !exact_tensors(args, 8, 13) || at::impl::torch_function_mode_enabled() ||
      !plain_int(args[7], &max_model_len)) {
    return PyObject_Vectorcall(entry.fallback, args, nargs, nullptr);
  }
  {
    GilRelease no_gil;
    entry.op->call(unpack(args[0]), unpack(args[1]), unpack(args[2]), unpack(args[3]), unpack(args[4]),
                   unpack(args[5]), unpack(args[6]), max_model_len, unpack(args[8]), unpack(args[9]),
                   unpack(args[10]), unpack(args[11]), unpack(args[12]));
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// create_output(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters) -> Tensor; the
// .counted overload when counters is not None.
PyObject* specdec_eager_create_output(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const CreateOutputEntry& entry = create_output_entry;
  if (!check_call("create_output", entry.fallback, nargs, 5)) return nullptr;
  const bool counted = args[4] != Py_None;
  if (!exact_tensors(args, 0, counted ? 5 : 4) || at::impl::torch_function_mode_enabled()) {
    return PyObject_Vectorcall(entry.fallback, args, nargs, nullptr);
  }
  Tensor result;
  {
    GilRelease no_gil;
    result = counted ? entry.counted_op->call(unpack(args[0]), unpack(args[1]), unpack(args[2]), unpack(args[3]),
                                              unpack(args[4]))
                     : entry.op->call(unpack(args[0]), unpack(args[1]), unpack(args[2]), unpack(args[3]));
  }
  return THPVariable_Wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

}  // extern "C"
