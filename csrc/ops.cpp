// Schemas of every op in the `specdec` namespace, in one place, and how the ops
// meet autograd.
//
// Each op's contract (shapes, dtypes, semantics) is documented in its Python
// module specdec_ops/ops/<family>.py, with its fake kernel; CPU kernels live in
// csrc/<family>.cpp, CUDA kernels (Triton) in specdec_ops/kernels/<family>.py.
// The seed ops (prepare_prefill, create_output) launch their Triton kernels
// from C++ (the rule: specdec_ops/kernels/launch.py).
#include <Python.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <vector>

// Lets `from specdec_ops import _C` load this library, which runs the
// registrations below (the extension-cpp pattern). Its functions connect the
// C++ CUDA launcher (csrc/triton_launch.cpp) with the Python side and give the
// wrappers of the C++-launched ops their eager calls (csrc/eager_entry.cpp).
extern "C" {
PyObject* specdec_set_triton_provider(PyObject* self, PyObject* fn);
PyObject* specdec_launch_geometry(PyObject* self, PyObject* unused);
PyObject* specdec_register_eager(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* specdec_eager_prepare_prefill(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* specdec_eager_prepare_prefill_into(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* specdec_eager_create_output(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

PyObject* PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"_set_triton_provider", specdec_set_triton_provider, METH_O,
       "Registers fn(kernel_name, signature, num_warps) -> (CUfunction, shared bytes)."},
      {"_launch_geometry", specdec_launch_geometry, METH_NOARGS,
       "Tile sizes and warps of the kernels launched from C++."},
      {"register_eager", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(specdec_register_eager)),
       METH_FASTCALL, "register_eager(name, fallback, result_type=None): the torch.ops path of an eager entry."},
      {"eager_prepare_prefill",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(specdec_eager_prepare_prefill)), METH_FASTCALL,
       "prepare_prefill's eager call, all nine arguments positional."},
      {"eager_prepare_prefill_into",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(specdec_eager_prepare_prefill_into)),
       METH_FASTCALL, "prepare_prefill_into's eager call, all thirteen arguments positional."},
      {"eager_create_output",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(specdec_eager_create_output)), METH_FASTCALL,
       "create_output's eager call: four tensors and counters (None picks the default overload)."},
      {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(specdec, m) {
  // Draft step-0 input expansion (specdec_ops/ops/prefill.py).
  m.def(
      "prepare_prefill(Tensor input_ids, Tensor positions, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor idx_mapping, Tensor last_sampled, Tensor num_rejected, int max_model_len, "
      "int? max_num_reqs=None) -> (Tensor expanded_input_ids, Tensor expanded_positions, "
      "Tensor last_token_indices, Tensor expanded_query_start_loc, Tensor expanded_seq_lens)");
  m.def(
      "prepare_prefill_into(Tensor input_ids, Tensor positions, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor idx_mapping, Tensor last_sampled, Tensor num_rejected, int max_model_len, "
      "Tensor(a!) expanded_input_ids, Tensor(b!) expanded_positions, Tensor(c!) last_token_indices, "
      "Tensor(d!) expanded_query_start_loc, Tensor(e!) expanded_seq_lens) -> ()");

  // Verified-token formatting (specdec_ops/ops/output.py).
  m.def(
      "create_output(Tensor accepted, Tensor substitute_token_ids, Tensor draft_token_ids, "
      "Tensor bonus_token_ids) -> Tensor");
  m.def(
      "create_output.counted(Tensor accepted, Tensor substitute_token_ids, Tensor draft_token_ids, "
      "Tensor bonus_token_ids, Tensor(a!) counters) -> Tensor");

  // Lossless rejection sampling and seeded draft sampling (specdec_ops/ops/sampling.py).
  m.def(
      "rejection_sample(Tensor target_probs, Tensor draft_token_ids, Tensor? draft_probs, Tensor seeds, "
      "Tensor offsets, Tensor? bonus_token_ids=None) -> Tensor");
  m.def(
      "rejection_sample.counted(Tensor target_probs, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor seeds, Tensor offsets, Tensor? bonus_token_ids, Tensor(a!) counters) -> Tensor");
  m.def("sample_draft(Tensor logits, Tensor temperature, Tensor seeds, Tensor positions) -> Tensor");
  m.def(
      "sample_draft.with_probs(Tensor logits, Tensor temperature, Tensor seeds, Tensor positions, "
      "Tensor(a!) probs) -> Tensor");

  // Deterministic verification (specdec_ops/ops/verify.py).
  m.def("greedy_verify(Tensor target_logits, Tensor draft_token_ids) -> Tensor");
  m.def("greedy_verify.counted(Tensor target_logits, Tensor draft_token_ids, Tensor(a!) counters) -> Tensor");
  m.def(
      "typical_acceptance(Tensor target_probs, Tensor draft_token_ids, float posterior_threshold=0.09, "
      "float posterior_alpha=0.3) -> Tensor");
  m.def(
      "typical_acceptance.counted(Tensor target_probs, Tensor draft_token_ids, float posterior_threshold, "
      "float posterior_alpha, Tensor(a!) counters) -> Tensor");

  // Verification and draft sampling from logits with temperature, top-k, top-p, min-p
  // (specdec_ops/ops/logits_sampling.py). An absent top_k, top_p or min_p is off for the whole batch.
  m.def(
      "rejection_sample_logits(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor? draft_logits, Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, Tensor seeds, "
      "Tensor offsets, bool block_verification=False) -> Tensor");
  m.def(
      "rejection_sample_logits.counted(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor? draft_logits, Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, Tensor seeds, "
      "Tensor offsets, bool block_verification, Tensor(a!) counters) -> Tensor");
  m.def(
      "rejection_sample_logits.logprobs(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor? draft_logits, Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, Tensor seeds, "
      "Tensor offsets, bool block_verification=False) -> (Tensor, Tensor)");
  m.def(
      "rejection_sample_logits.logprobs_counted(Tensor target_logits, Tensor draft_token_ids, "
      "Tensor? draft_probs, Tensor? draft_logits, Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, "
      "Tensor seeds, Tensor offsets, bool block_verification, Tensor(a!) counters) -> (Tensor, Tensor)");
  m.def(
      "sample_draft_filtered(Tensor logits, Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, "
      "Tensor seeds, Tensor positions) -> Tensor");
  m.def(
      "sample_draft_filtered.with_probs(Tensor logits, Tensor temperature, Tensor? top_k, Tensor? top_p, "
      "Tensor? min_p, Tensor seeds, Tensor positions, Tensor(a!) probs) -> Tensor");

  // One decode step of the draft loop (specdec_ops/ops/draft_step.py).
  m.def(
      "advance_draft_step(Tensor sampled_token_ids, Tensor positions, Tensor seq_lens, int max_model_len) "
      "-> (Tensor input_ids, Tensor next_positions, Tensor next_seq_lens)");
}

// How the ops meet autograd. Their mutated tensors get their version counters
// bumped, as aten's in-place ops do, so autograd reports a tensor it saved for
// backward that one of these ops overwrote (inference tensors have no counter).
namespace {

void bump_mutated_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  std::vector<at::Tensor> mutated;  // kept before the call consumes the stack
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    const c10::IValue& value = (*stack)[first + i];
    if (alias != nullptr && alias->isWrite() && value.isTensor()) mutated.push_back(value.toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& tensor : mutated) {
    if (!tensor.is_inference()) tensor.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, ADInplaceOrView, m) {
  for (const char* name : {"prepare_prefill_into", "create_output.counted", "rejection_sample.counted",
                           "sample_draft.with_probs", "greedy_verify.counted", "typical_acceptance.counted",
                           "rejection_sample_logits.counted", "rejection_sample_logits.logprobs_counted",
                           "sample_draft_filtered.with_probs"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&bump_mutated_versions>());
  }
}

// The two seed ops take and return integer tensors only, which cannot require grad, so autograd's fallback has
// nothing to do: falling through it keeps their eager calls (csrc/eager_entry.cpp) unboxed down to the kernel.
TORCH_LIBRARY_IMPL(specdec, Autograd, m) {
  for (const char* name : {"prepare_prefill", "prepare_prefill_into", "create_output", "create_output.counted"}) {
    m.impl(name, torch::CppFunction::makeFallthrough());
  }
}
