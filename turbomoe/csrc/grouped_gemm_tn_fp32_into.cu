// The grouped weight-gradient GEMM into an fp32 buffer, d[g] = (or +=) a[rows_g]^T @ b[rows_g]: see
// grouped_gemm.cuh.
#include "grouped_gemm.cuh"

namespace turbomoe {
void grouped_mm_tn_fp32_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& d, bool accumulate) {
  gmm::grouped_mm_wgrad_into<float, true>(a, b, offs, d, accumulate);
}
}  // namespace turbomoe
