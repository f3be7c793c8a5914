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
template <class LayoutB, class Tile = cute::Shape<cute::_128, cute::_256, cute::_64>,
          class Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>>
struct Gemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, Row*, 8, Elt, Row*, 8,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Elt, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elt, Row*, 8, Elt, LayoutB*, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// One thread per group: its shape (rows, N, K), operand pointers and packed strides. Templated on
// the stride types themselves, not on Gemm: nvcc's host stub cannot spell Gemm's nested aliases.
// Offsets are clamped to [0, R]: counts that sum past R (a caller's error the host cannot see
// without a sync) truncate the last groups, as the reference's slicing does, instead of writing
// out of bounds.
template <class Shape3, class StrideA, class StrideB, class StrideD>
__global__ void prepare_groups(const int* __restrict__ offs, int num_groups, int R, int K, int N, const Elt* x,
                               const Elt* w, int64_t group_stride, Elt* y, Shape3* shapes, const Elt** ptr_x, const Elt** ptr_w, Elt** ptr_y,
                               StrideA* stride_x, StrideB* stride_w, StrideD* stride_y) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= num_groups) return;
  const int64_t start = g ? min(max(offs[g - 1], 0), R) : 0;
  const int rows = max(min(max(offs[g], 0), R) - static_cast<int>(start), 0);
  shapes[g] = {rows, N, K};
  ptr_x[g] = x + start * K;
  ptr_w[g] = w + g * group_stride;
  ptr_y[g] = y + start * N;
  stride_x[g] = cutlass::make_cute_packed_stride(StrideA{}, {rows, K, 1});
  stride_w[g] = cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1});
  stride_y[g] = cutlass::make_cute_packed_stride(StrideD{}, {rows, N, 1});
}

inline size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// y [R, N] (allocated by the caller) from x [R, K], w [G, K, N] and offs [G]; shapes checked by the caller.
template <class LayoutB>
void grouped_mm_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor& y) {
  using G = Gemm<LayoutB>;
  const int num_groups = static_cast<int>(offs.size(0));
  const int K = static_cast<int>(x.size(1)), N = static_cast<int>(y.size(1));
  c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // The per-group argument arrays and CUTLASS's own workspace share one allocation.
  const size_t per_group[7] = {sizeof(typename G::Shape3), sizeof(void*), sizeof(void*), sizeof(void*),
                               sizeof(typename G::StrideA), sizeof(typename G::StrideB), sizeof(typename G::StrideD)};
  size_t arrays = 0;
  for (size_t bytes : per_group) arrays += align256(bytes * num_groups);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = x.get_device();
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
  typename G::Device::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {num_groups, nullptr, nullptr},
                                     {nullptr, nullptr, nullptr, nullptr},
                                     {{}, nullptr, nullptr, nullptr, nullptr},
                                     hw};
  const size_t cutlass_bytes = G::Device::get_workspace_size(args);
  at::Tensor work = at::empty({static_cast<int64_t>(arrays + cutlass_bytes)}, x.options().dtype(at::kByte));
  char* p = static_cast<char*>(work.data_ptr());
  void* slot[7];
  for (int i = 0; i < 7; ++i) {
    slot[i] = p;
    p += align256(per_group[i] * num_groups);
  }
  auto* shapes = static_cast<typename G::Shape3*>(slot[0]);
  auto* ptr_x = static_cast<const Elt**>(slot[1]);
  auto* ptr_w = static_cast<const Elt**>(slot[2]);
  auto* ptr_y = static_cast<Elt**>(slot[3]);
  auto* stride_x = static_cast<typename G::StrideA*>(slot[4]);
  auto* stride_w = static_cast<typename G::StrideB*>(slot[5]);
  auto* stride_y = static_cast<typename G::StrideD*>(slot[6]);
  prepare_groups<<<(num_groups + 127) / 128, 128, 0, stream>>>(
      offs.data_ptr<int>(), num_groups, static_cast<int>(x.size(0)), K, N, reinterpret_cast<const Elt*>(x.data_ptr()),
      reinterpret_cast<const Elt*>(w.data_ptr()), w.stride(0), reinterpret_cast<Elt*>(y.data_ptr()), shapes, ptr_x, ptr_w, ptr_y,
      stride_x, stride_w, stride_y);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  args.problem_shape = {num_groups, shapes, nullptr};  // shapes on the device only: no host sync
  args.mainloop = {ptr_x, stride_x, ptr_w, stride_w};
  args.epilogue = {{}, nullptr, nullptr, ptr_y, stride_y};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  typename G::Device gemm;
  TORCH_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, "turbomoe grouped GEMM: CUTLASS cannot run ",
              "K = ", K, ", N = ", N);
  TORCH_CHECK(gemm.initialize(args, p, stream) == cutlass::Status::kSuccess,
              "turbomoe grouped GEMM: CUTLASS initialisation failed");
  TORCH_CHECK(gemm.run(stream) == cutlass::Status::kSuccess, "turbomoe grouped GEMM: CUTLASS launch failed");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace gmm
}  // namespace turbomoe
