// Grouped GEMM over expert-contiguous rows on Hopper, from CUTLASS 3's sm90 ptr-array kernel
// (TMA loads, warp-specialised cooperative wgmma, persistent group tile scheduler):
//
//   y[rows_g] = x[rows_g] @ w[g]      x [R, K] bf16 row-major, w [G, K, N] bf16, y [R, N] bf16
//
// rows_g = offs[g-1] .. offs[g] (inclusive int32 offsets, on the device); w[g] starts group_stride
// elements after w[g-1] (K * N when w is one tensor; more when the groups are parameters packed with
// others between them, as the drop-in's stacked experts are). One small kernel turns the
// offsets into the per-group problem shapes, pointers and strides that CUTLASS reads on the device,
// so nothing here syncs with the host and the launch is CUDA-graph capturable. LayoutB is RowMajor
// for each w[g] a row-major [K, N] (N-major) and ColumnMajor for each w[g] a transposed view of a
// row-major [N, K] (the input gradient dx = dy @ w^T). Rows past offs[G-1] are not written.
//
// The weight gradient, with the groups' rows as the reduction:
//
//   d[g] = a[rows_g]^T @ b[rows_g]    a [R, M], b [R, N] bf16 row-major, d [G, M, N] bf16
//
// A is a[rows_g] read M-major (ColumnMajor), B is b[rows_g] (RowMajor). Each group has the same
// M x N tiles and a K of its own, so under the persistent scheduler's static order (tile i on SM
// i mod #SMs) a long group's tiles land on a run of SMs and the step waits for them. The problems
// are handed over longest first (LPT order; results do not depend on it: one CTA sums each tile in
// row order). Empty groups get no problem (CUTLASS leaves a K = 0 problem's accumulators unset, and
// TMA refuses a zero extent): the same kernel writes their zeros. d may also be fp32 (an fp32 gradient
// buffer written directly), and the instantiations with a source may add to d instead (d read as the
// epilogue's C: gradient-accumulation fusion into an fp32 main_grad, 1.19-1.52x a bf16 dw and an add,
// 1.23-1.33x the Triton kernel's fused add, H100, 2026-11-25; or into a bf16 .grad). Tile 128 x 256 x 64 as above, with
// 2 x 1 clusters (as torch._grouped_mm's kernel, whose bits it matches): against that kernel on the
// H100 (notes/bench_layer.md, 2026-11-25) 0.99-1.04x as fast with balanced groups of 2048-4096 rows,
// up to 1.22x with unbalanced ones; 0.96-1.07x at 256-768 rows a group, where the caller keeps torch's.
//
// Tiles tried against this one on the H100 (notes/bench_layer.md, 2026-11-24): 64 x 256 and 128 x 128
// ping-pong, 128 x 128 cooperative: 4-40% slower at every shape of the layer benchmark and the recipes.
//
// Tile 128 x 256 x 64 and no thread-block cluster: at 256 rows per expert (E = 64 in the layer
// benchmark), a 2 x 1 cluster or torch._grouped_mm's kernel was 18-34% slower (notes/bench_layer.md).
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <type_traits>

// CUTLASS's own include order (its builders need cutlass.h and the dispatch policies first).
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace turbomoe {
namespace gmm {

using Elt = cutlass::bfloat16_t;
using Row = cutlass::layout::RowMajor;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group

// Tile and Cluster are template parameters, not member aliases: a builder type that does not depend
// on the template's parameters is instantiated early, and nvcc's host pass then fails on CUTLASS.
// Out: d's element type; Src: void (d = acc) or Out (d = acc + beta d, d read as C unless beta is 0).
template <class LayoutA, class LayoutB, class Tile = cute::Shape<cute::_128, cute::_256, cute::_64>,
          class Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>, class Out = Elt, class Src = void>
struct Gemm {
  static constexpr int kOutAlign = 16 / sizeof(Out);
  using OutT = Out;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Src, Row*, kOutAlign, Out, Row*, kOutAlign,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Out, float, std::conditional_t<std::is_void_v<Src>, Out, Src>>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elt, LayoutA*, 8, Elt, LayoutB*, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// Offset g clamped to [0, R] (the inclusive end of group g's rows): counts that sum past R (a
// caller's error the host cannot see without a sync) truncate the last groups, as the reference's
// slicing does, instead of writing out of bounds.
__device__ __forceinline__ int clamped_offset(const int* __restrict__ offs, int g, int R) { return min(max(offs[g], 0), R); }

// One thread per group: its shape (rows, N, K), operand pointers and packed strides. Templated on
// the stride types themselves, not on Gemm: nvcc's host stub cannot spell Gemm's nested aliases.
template <class Shape3, class StrideA, class StrideB, class StrideD>
__global__ void prepare_groups(const int* __restrict__ offs, int num_groups, int R, int K, int N, const Elt* x,
                               const Elt* w, int64_t group_stride, Elt* y, Shape3* shapes, const Elt** ptr_x, const Elt** ptr_w, Elt** ptr_y,
                               StrideA* stride_x, StrideB* stride_w, StrideD* stride_y) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= num_groups) return;
  const int64_t start = g ? clamped_offset(offs, g - 1, R) : 0;
  const int rows = max(clamped_offset(offs, g, R) - static_cast<int>(start), 0);
  shapes[g] = {rows, N, K};
  ptr_x[g] = x + start * K;
  ptr_w[g] = w + g * group_stride;
  ptr_y[g] = y + start * N;
  stride_x[g] = cutlass::make_cute_packed_stride(StrideA{}, {rows, K, 1});
  stride_w[g] = cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1});
  stride_y[g] = cutlass::make_cute_packed_stride(StrideD{}, {rows, N, 1});
}

inline size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// The per-group argument arrays CUTLASS reads on the device, filled by a kernel of the caller's.
template <class G>
struct GroupArgs {
  typename G::Shape3* shapes;
  const Elt** ptr_a;
  const Elt** ptr_b;
  typename G::OutT** ptr_d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
};

// Allocates the argument arrays and CUTLASS's workspace (one tensor), lets `prepare(args, stream)`
// launch the kernel that fills them, then runs the grouped GEMM behind it on the same stream: the
// shapes live on the device only, so nothing syncs with the host. With a source (G's Src not void)
// d = acc + beta d: d is read as C through the same pointers and strides, unless beta is 0 (CUTLASS's
// epilogue then loads no C).
template <class G, class Prepare>
void run_grouped(const at::Tensor& like, int num_groups, Prepare prepare, float beta = 0.0f) {
  c10::cuda::CUDAGuard guard(like.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const size_t per_group[7] = {sizeof(typename G::Shape3), sizeof(void*), sizeof(void*), sizeof(void*),
                               sizeof(typename G::StrideA), sizeof(typename G::StrideB), sizeof(typename G::StrideD)};
  size_t arrays = 0;
  for (size_t bytes : per_group) arrays += align256(bytes * num_groups);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = like.get_device();
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
  typename G::Device::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {num_groups, nullptr, nullptr},
                                     {nullptr, nullptr, nullptr, nullptr},
                                     {{}, nullptr, nullptr, nullptr, nullptr},
                                     hw};
  const size_t cutlass_bytes = G::Device::get_workspace_size(args);
  at::Tensor work = at::empty({static_cast<int64_t>(arrays + cutlass_bytes)}, like.options().dtype(at::kByte));
  char* p = static_cast<char*>(work.data_ptr());
  void* slot[7];
  for (int i = 0; i < 7; ++i) {
    slot[i] = p;
    p += align256(per_group[i] * num_groups);
  }
  GroupArgs<G> ga{static_cast<typename G::Shape3*>(slot[0]), static_cast<const Elt**>(slot[1]),
                  static_cast<const Elt**>(slot[2]), static_cast<typename G::OutT**>(slot[3]),
                  static_cast<typename G::StrideA*>(slot[4]), static_cast<typename G::StrideB*>(slot[5]),
                  static_cast<typename G::StrideD*>(slot[6])};
  prepare(ga, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  args.problem_shape = {num_groups, ga.shapes, nullptr};  // shapes on the device only: no host sync
  args.mainloop = {ga.ptr_a, ga.stride_a, ga.ptr_b, ga.stride_b};
  using Source = typename G::Epilogue::ElementC;
  if constexpr (!std::is_void_v<Source>) {
    static_assert(std::is_same_v<Source, typename G::OutT> && std::is_same_v<typename G::StrideC, typename G::StrideD>,
                  "C is read through D's pointers and strides");
    args.epilogue = {{}, const_cast<const Source**>(ga.ptr_d), ga.stride_d, ga.ptr_d, ga.stride_d};
  } else {
    TORCH_CHECK(beta == 0.0f, "turbomoe grouped GEMM: this kernel has no source to scale by beta");
    args.epilogue = {{}, nullptr, nullptr, ga.ptr_d, ga.stride_d};
  }
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = beta;
  typename G::Device gemm;
  TORCH_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, "turbomoe grouped GEMM: CUTLASS cannot run ",
              "these shapes");
  TORCH_CHECK(gemm.initialize(args, p, stream) == cutlass::Status::kSuccess,
              "turbomoe grouped GEMM: CUTLASS initialisation failed");
  TORCH_CHECK(gemm.run(stream) == cutlass::Status::kSuccess, "turbomoe grouped GEMM: CUTLASS launch failed");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// y [R, N] (allocated by the caller) from x [R, K], w [G, K, N] and offs [G]; shapes checked by the caller.
template <class LayoutB>
void grouped_mm_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor& y) {
  using G = Gemm<Row, LayoutB>;
  const int num_groups = static_cast<int>(offs.size(0));
  const int K = static_cast<int>(x.size(1)), N = static_cast<int>(y.size(1));
  run_grouped<G>(x, num_groups, [&](GroupArgs<G>& a, cudaStream_t stream) {
    prepare_groups<<<(num_groups + 127) / 128, 128, 0, stream>>>(
        offs.data_ptr<int>(), num_groups, static_cast<int>(x.size(0)), K, N, reinterpret_cast<const Elt*>(x.data_ptr()),
        reinterpret_cast<const Elt*>(w.data_ptr()), w.stride(0), reinterpret_cast<Elt*>(y.data_ptr()), a.shapes,
        a.ptr_a, a.ptr_b, a.ptr_d, a.stride_a, a.stride_b, a.stride_d);
  });
}

constexpr int kWgradPrepareThreads = 256;

// Grid (G, Z). Block (g, 0) finds group g's rank in the longest-first order (ties by index: a fixed
// order) and writes its problem there; a group with no rows becomes an empty problem (M = 0: no
// tiles) placed last, and (when d is written, not added to) the Z blocks of group g write its zeros.
// d[g] starts d_group_stride elements after d[g - 1], each a contiguous [M, N].
template <class Shape3, class StrideA, class StrideB, class StrideD, class T>
__global__ void prepare_wgrad_groups(const int* __restrict__ offs, int num_groups, int R, int M, int N, const Elt* a,
                                     const Elt* b, T* d, int64_t d_group_stride, bool zero_empty, Shape3* shapes, const Elt** ptr_a,
                                     const Elt** ptr_b, T** ptr_d, StrideA* stride_a, StrideB* stride_b,
                                     StrideD* stride_d) {
  const int g = blockIdx.x;
  auto rows_of = [&](int h) { return max(clamped_offset(offs, h, R) - (h ? clamped_offset(offs, h - 1, R) : 0), 0); };
  const int rows = rows_of(g);
  const int64_t MN = static_cast<int64_t>(M) * N;
  if (rows == 0 && zero_empty) {  // zeros, 16 bytes a store (M N elements fill whole 16-byte words)
    uint4* out = reinterpret_cast<uint4*>(d + g * d_group_stride);
    const int64_t words = MN * sizeof(T) / 16;
    for (int64_t i = blockIdx.y * blockDim.x + threadIdx.x; i < words; i += gridDim.y * blockDim.x) out[i] = uint4{0, 0, 0, 0};
  }
  if (blockIdx.y != 0) return;
  __shared__ int before;
  if (threadIdx.x == 0) before = 0;
  __syncthreads();
  int mine = 0;
  for (int h = threadIdx.x; h < num_groups; h += blockDim.x) {
    const int r = rows_of(h);
    mine += r > rows || (r == rows && h < g);
  }
  atomicAdd(&before, mine);
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int i = before;
  const int64_t start = g ? clamped_offset(offs, g - 1, R) : 0;
  shapes[i] = {rows ? M : 0, N, max(rows, 1)};
  ptr_a[i] = a + start * M;
  ptr_b[i] = b + start * N;
  ptr_d[i] = d + g * d_group_stride;
  stride_a[i] = cutlass::make_cute_packed_stride(StrideA{}, {M, max(rows, 1), 1});
  stride_b[i] = cutlass::make_cute_packed_stride(StrideB{}, {N, max(rows, 1), 1});
  stride_d[i] = cutlass::make_cute_packed_stride(StrideD{}, {M, N, 1});
}

// d [G, M, N] (each d[g] a contiguous [M, N], 16-byte aligned; allocated by the caller) =
// a[rows_g]^T @ b[rows_g] from a [R, M], b [R, N] and offs [G], d bf16 or fp32 (an fp32 main_grad
// written in place: no bf16 gradient and no cast after); or, with a source (kSource) and accumulate,
// d += a[rows_g]^T @ b[rows_g] (empty groups untouched: Megatron's gradient-accumulation fusion into an
// fp32 main_grad, or into a bf16 .grad). Without kSource the epilogue keeps no shared memory for C.
// Shapes checked by the caller.
template <class Out, bool kSource>
void grouped_mm_wgrad_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& d,
                           bool accumulate) {
  using G = Gemm<cutlass::layout::ColumnMajor, Row, cute::Shape<cute::_128, cute::_256, cute::_64>,
                 cute::Shape<cute::_2, cute::_1, cute::_1>, Out, std::conditional_t<kSource, Out, void>>;
  const int num_groups = static_cast<int>(offs.size(0));
  const int M = static_cast<int>(a.size(1)), N = static_cast<int>(b.size(1));
  run_grouped<G>(a, num_groups, [&](GroupArgs<G>& ga, cudaStream_t stream) {
    const dim3 grid(num_groups, accumulate ? 1 : 16);
    prepare_wgrad_groups<<<grid, kWgradPrepareThreads, 0, stream>>>(
        offs.data_ptr<int>(), num_groups, static_cast<int>(a.size(0)), M, N, reinterpret_cast<const Elt*>(a.data_ptr()),
        reinterpret_cast<const Elt*>(b.data_ptr()), reinterpret_cast<Out*>(d.data_ptr()), d.stride(0), !accumulate,
        ga.shapes, ga.ptr_a, ga.ptr_b, ga.ptr_d, ga.stride_a, ga.stride_b, ga.stride_d);
  }, accumulate ? 1.0f : 0.0f);
}

}  // namespace gmm
}  // namespace turbomoe
