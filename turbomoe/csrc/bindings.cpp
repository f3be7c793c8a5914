// Python bindings of turbomoe's CUDA kernels (turbomoe/csrc/__init__.py wraps them with the same
// signatures as the Triton launchers in turbomoe/kernels/).
#include <torch/extension.h>

namespace turbomoe {
std::vector<at::Tensor> gating_forward(const at::Tensor& logits, int64_t k, bool sigmoid, bool renorm,
                                       const c10::optional<at::Tensor>& bias, double coef);
at::Tensor gating_backward(const at::Tensor& logits, const at::Tensor& ids, const c10::optional<at::Tensor>& grad_scores,
                           const at::Tensor& ce, const c10::optional<at::Tensor>& g_aux,
                           const c10::optional<at::Tensor>& g_z, bool sigmoid, bool renorm, double coef);
std::vector<at::Tensor> assign_slots(const at::Tensor& ids, const c10::optional<at::Tensor>& scores, int64_t E,
                                     int64_t capacity, int64_t policy, int64_t seed_mix);
void push_rows(const at::Tensor& src, const at::Tensor& slots, at::Tensor& out, const c10::optional<at::Tensor>& kept,
               int64_t capacity, const c10::optional<at::Tensor>& scores, const c10::optional<at::Tensor>& y,
               const c10::optional<at::Tensor>& dscores, bool renorm);
void pull_rows(const at::Tensor& y, const at::Tensor& slots, at::Tensor& out, const c10::optional<at::Tensor>& scores,
               bool renorm);
std::vector<at::Tensor> second_expert_forward(const at::Tensor& logits, const at::Tensor& first,
                                              const at::Tensor& first_score, const at::Tensor& counts_first,
                                              const c10::optional<at::Tensor>& rand);
std::vector<at::Tensor> second_expert_backward(const at::Tensor& logits, const at::Tensor& ids,
                                               const at::Tensor& first_score, const at::Tensor& grad_scores);
std::vector<at::Tensor> index_shuffling(const at::Tensor& logits, int64_t k, bool shared, bool sigmoid, bool renorm);
}  // namespace turbomoe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gating_forward", &turbomoe::gating_forward, "logits -> ids, scores, counts, ce, aux, z, lse");
  m.def("gating_backward", &turbomoe::gating_backward, "grad of scores, aux and z -> grad of logits");
  m.def("assign_slots", &turbomoe::assign_slots, "expert ids -> slots, kept counts");
  m.def("push_rows", &turbomoe::push_rows, "out[slots[s, j]] = (weight *) src[s]; optional dot products");
  m.def("pull_rows", &turbomoe::pull_rows, "out[s] = sum_j (weight *) y[slots[s, j]]");
  m.def("second_expert_forward", &turbomoe::second_expert_forward,
        "second expert of top-2 gating: Gumbel-max, or the best other logit");
  m.def("second_expert_backward", &turbomoe::second_expert_backward, "grad of its scores -> grad of logits");
  m.def("index_shuffling", &turbomoe::index_shuffling, "logits -> ids, scores, counts, slots, row_routes");
}
