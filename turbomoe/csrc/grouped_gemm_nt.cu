// The grouped GEMM with each w[g] a transposed view of a row-major [N, K] (the input gradient dx = dy @ w^T):
// see grouped_gemm.cuh.
#include "grouped_gemm.cuh"

namespace turbomoe {
void grouped_mm_nt(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor& y) {
  gmm::grouped_mm_into<cutlass::layout::ColumnMajor>(x, w, offs, y);
}
}  // namespace turbomoe
