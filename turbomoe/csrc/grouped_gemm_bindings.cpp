// Python binding of the CUTLASS grouped GEMM (a separate extension from the gating kernels: it needs
// CUTLASS's headers and sm90a; turbomoe/csrc/__init__.py builds it). The checks here keep every bad
// input a Python error; the Python front (turbomoe/autograd/grouped_gemm.py) routes only bf16 on sm90.
#include <torch/extension.h>

namespace turbomoe {
void grouped_mm_nn(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor& y);
void grouped_mm_nt(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor& y);
void grouped_mm_tn(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& d);
void grouped_mm_tn_fp32_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& d, bool accumulate);
void grouped_mm_tn_bf16_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& d, bool accumulate);

// y [R, N] with y[rows_g] = x[rows_g] @ w[g]; rows past offs[G-1] unspecified.
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  TORCH_CHECK(x.is_cuda() && w.device() == x.device() && offs.device() == x.device(),
              "grouped_mm: x, w and offs must be on one CUDA device");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "grouped_mm: x and w must be bf16");
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.dim() == 1 && offs.is_contiguous(),
              "grouped_mm: offs must be a contiguous int32 [G]");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(0) == offs.size(0) && w.size(1) == x.size(1),
              "grouped_mm: x must be [R, K], w [G, K, N] and offs [G]");
  const int64_t R = x.size(0), K = x.size(1), G = w.size(0), N = w.size(2);
  TORCH_CHECK(K % 8 == 0 && N % 8 == 0, "grouped_mm: K and N must be multiples of 8 (16-byte rows for TMA)");
  TORCH_CHECK(x.is_contiguous(), "grouped_mm: x must be contiguous");
  // Each group [K, N] row-major or column-major; the groups any 16-byte-aligned distance apart.
  const bool n_major = w.stride(2) == 1 && w.stride(1) == N;
  const bool k_major = w.stride(1) == 1 && w.stride(2) == K;
  TORCH_CHECK(n_major || k_major, "grouped_mm: each w[g] must be a contiguous [K, N] or the transpose of a contiguous [N, K]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 &&
              (G == 1 || w.stride(0) % 8 == 0),
              "grouped_mm: x, w and every w[g] must be 16-byte aligned");
  at::Tensor y = at::empty({R, N}, x.options());
  if (R == 0 || N == 0 || G == 0) return y;
  if (K == 0) return y.zero_();  // CUTLASS leaves the accumulators of a K = 0 problem unset
  TORCH_CHECK(R < (int64_t(1) << 31) && G < (int64_t(1) << 31), "grouped_mm: R and G must fit in int32");
  (n_major ? grouped_mm_nn : grouped_mm_nt)(x, w, offs, y);
  return y;
}

// The checks shared by the weight-gradient entry points: a [R, M], b [R, N] bf16, offs int32 [G].
static void check_wgrad_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  TORCH_CHECK(a.is_cuda() && b.device() == a.device() && offs.device() == a.device(),
              "grouped_mm_wgrad: a, b and offs must be on one CUDA device");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16, "grouped_mm_wgrad: a and b must be bf16");
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.dim() == 1 && offs.is_contiguous(),
              "grouped_mm_wgrad: offs must be a contiguous int32 [G]");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0), "grouped_mm_wgrad: a must be [R, M] and b [R, N]");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "grouped_mm_wgrad: a and b must be contiguous");
  TORCH_CHECK(a.size(1) % 8 == 0 && b.size(1) % 8 == 0, "grouped_mm_wgrad: M and N must be multiples of 8 (16-byte rows for TMA)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0,
              "grouped_mm_wgrad: a and b must be 16-byte aligned");
  TORCH_CHECK(a.size(0) < (int64_t(1) << 31) && offs.size(0) < 65536 && a.size(1) * b.size(1) < (int64_t(1) << 40),
              "grouped_mm_wgrad: sizes out of range");
}

// d [G, M, N] with d[g] = a[rows_g]^T @ b[rows_g] (the weight gradient); zero for empty groups.
at::Tensor grouped_mm_wgrad(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  check_wgrad_args(a, b, offs);
  const int64_t R = a.size(0), M = a.size(1), N = b.size(1), G = offs.size(0);
  if (R == 0 || G == 0 || M == 0 || N == 0) return at::zeros({G, M, N}, a.options());
  at::Tensor d = at::empty({G, M, N}, a.options());
  grouped_mm_tn(a, b, offs, d);
  return d;
}

// d[g] = (accumulate: +=) a[rows_g]^T @ b[rows_g] in place, d an fp32 or bf16 [G, M, N] whose groups
// are contiguous [M, N] blocks any 16-byte-aligned distance apart (a main_grad, an optimizer's flat fp32
// gradients seen per expert, or a parameter's .grad); written, empty groups get zeros, added, they are
// untouched. Returns d.
at::Tensor grouped_mm_wgrad_into_(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor d,
                                  bool accumulate) {
  check_wgrad_args(a, b, offs);
  const bool fp32 = d.scalar_type() == at::kFloat;
  TORCH_CHECK((fp32 || d.scalar_type() == at::kBFloat16) && d.device() == a.device(),
              "grouped_mm_wgrad_into_: d must be an fp32 or bf16 tensor on a's device");
  TORCH_CHECK(d.dim() == 3 && d.size(0) == offs.size(0) && d.size(1) == a.size(1) && d.size(2) == b.size(1),
              "grouped_mm_wgrad_into_: d must be [G, M, N]");
  if (d.numel() == 0) return d;
  TORCH_CHECK(d.stride(2) == 1 && d.stride(1) == d.size(2) && (d.size(0) == 1 || d.stride(0) * d.element_size() % 16 == 0) &&
                  reinterpret_cast<uintptr_t>(d.data_ptr()) % 16 == 0,
              "grouped_mm_wgrad_into_: each d[g] must be a contiguous [M, N], 16-byte aligned");
  if (a.size(0) == 0) return accumulate ? d : d.zero_();
  (fp32 ? grouped_mm_tn_fp32_into : grouped_mm_tn_bf16_into)(a, b, offs, d, accumulate);
  return d;
}
}  // namespace turbomoe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_mm", &turbomoe::grouped_mm, "y[rows_g] = x[rows_g] @ w[g] over expert-contiguous rows (CUTLASS, sm90)");
  m.def("grouped_mm_wgrad", &turbomoe::grouped_mm_wgrad, "d[g] = a[rows_g]^T @ b[rows_g] over expert-contiguous rows (CUTLASS, sm90)");
  m.def("grouped_mm_wgrad_into_", &turbomoe::grouped_mm_wgrad_into_,
        "d[g] = (or +=) a[rows_g]^T @ b[rows_g] in place, d fp32 or bf16 (CUTLASS, sm90)");
}
