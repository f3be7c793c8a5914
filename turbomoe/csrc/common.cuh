// Shared helpers of turbomoe's CUDA kernels: warp reductions in a fixed order (deterministic),
// 16-byte row vectors, and the launch checks.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

namespace turbomoe {

constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int WARP = 32;
constexpr int WARPS_PER_BLOCK = 8;  // every kernel here runs blocks of 8 warps
constexpr int BLOCK_THREADS = WARP * WARPS_PER_BLOCK;
constexpr int MAX_EXPERTS = 1024;  // 32 columns per lane in the gating kernels, 36 KB of counters in slots
constexpr int MAX_K = 8;

// Routing math in fp32, or fp64 when the caller works in fp64 (gradcheck), as reference.compute_dtype.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

// Butterfly reductions: every lane ends with the same value, summed in the same order every run.
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

template <typename T> __device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// The same over the LANES threads that own a row or token: a warp (LANES = WARP), or one thread (1),
// where there is nothing to reduce.
template <int LANES, typename T> __device__ __forceinline__ T lanes_sum(T v) {
  if constexpr (LANES == 1) return v;
  else return warp_sum(v);
}

template <int LANES, typename T> __device__ __forceinline__ T lanes_max(T v) {
  if constexpr (LANES == 1) return v;
  else return warp_max(v);
}

template <int LANES> __device__ __forceinline__ bool lanes_any(bool b) {
  if constexpr (LANES == 1) return b;
  else return __any_sync(FULL_MASK, b);
}

// VEC elements of T moved as one load or store (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

inline bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

#define TURBOMOE_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()

// The launchers' shape check of a 2-D operand: on the GPU, two dims, contiguous.
inline void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), name, ": contiguous CUDA 2-D tensor");
}

// Columns of a row each lane of a warp holds (a power of two, at most 32: E <= MAX_EXPERTS).
inline int columns_per_lane(int E) {
  int cpl = 1;
  while (cpl * WARP < E) cpl *= 2;
  return cpl;
}

// Runs the lambda with constexpr int CPL = columns_per_lane(E) in scope.
#define TURBOMOE_DISPATCH_CPL(E, ...)                                   \
  switch (turbomoe::columns_per_lane(E)) {                             \
    case 1: { constexpr int CPL = 1; __VA_ARGS__(); break; }            \
    case 2: { constexpr int CPL = 2; __VA_ARGS__(); break; }            \
    case 4: { constexpr int CPL = 4; __VA_ARGS__(); break; }            \
    case 8: { constexpr int CPL = 8; __VA_ARGS__(); break; }            \
    case 16: { constexpr int CPL = 16; __VA_ARGS__(); break; }          \
    default: { constexpr int CPL = 32; __VA_ARGS__(); break; }          \
  }

// Up to this many experts a thread owns a gating row (gating.cu): all its columns in registers.
constexpr int THREAD_ROW_EXPERTS = 16;

// Threads that own a gating row of E experts: one, or a warp (TURBOMOE_DISPATCH_ROW's LANES).
constexpr int row_lanes(int E) { return E <= THREAD_ROW_EXPERTS ? 1 : WARP; }

// Runs the lambda with constexpr int CPL and LANES in scope: a thread a row with CPL >= E columns (8 or
// 16) up to THREAD_ROW_EXPERTS, else a warp a row with CPL = columns_per_lane(E).
#define TURBOMOE_DISPATCH_ROW(E, ...)                                                              \
  if ((E) <= 8) { constexpr int CPL = 8, LANES = 1; __VA_ARGS__(); }                               \
  else if (turbomoe::row_lanes(E) == 1) { constexpr int CPL = 16, LANES = 1; __VA_ARGS__(); }        \
  else TURBOMOE_DISPATCH_CPL(E, [&] { constexpr int LANES = turbomoe::WARP; __VA_ARGS__(); });

}  // namespace turbomoe
