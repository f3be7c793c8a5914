// The grouped weight-gradient GEMM d[g] = a[rows_g]^T @ b[rows_g], bf16 d: see grouped_gemm.cuh.
#include "grouped_gemm.cuh"

namespace turbomoe {
void grouped_mm_tn(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& d) {
  gmm::grouped_mm_wgrad_into<cutlass::bfloat16_t, false>(a, b, offs, d, false);
}
}  // namespace turbomoe
