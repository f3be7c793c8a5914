// The grouped GEMM with each w[g] a row-major [K, N] (the forward pass): see grouped_gemm.cuh.
#include "grouped_gemm.cuh"

namespace turbomoe {
void grouped_mm_nn(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor& y) {
  gmm::grouped_mm_into<cutlass::layout::RowMajor>(x, w, offs, y);
}
}  // namespace turbomoe
