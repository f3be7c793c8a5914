// The grouped weight-gradient GEMM into a bf16 buffer in place, d[g] = (or +=) a[rows_g]^T @ b[rows_g]
// (a parameter's .grad accumulating micro-batches): see grouped_gemm.cuh.
#include "grouped_gemm.cuh"

namespace turbomoe {
void grouped_mm_tn_bf16_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& d,
                             bool accumulate) {
  gmm::grouped_mm_wgrad_into<cutlass::bfloat16_t, true>(a, b, offs, d, accumulate);
}
}  // namespace turbomoe
