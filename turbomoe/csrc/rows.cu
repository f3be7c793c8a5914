// Rows between the token layout [S, M] and the expert buffer [R, M], in CUDA; the same two
// kernels as the Triton ones (turbomoe/kernels/rows.py), so each output row has one writer:
//   push_rows  token s writes (score *) src[s] into row slots[s, j], for every j: scatter forward,
//              and gather backward (where it also forms grad_score = <src[s], y[row]> in fp32)
//   pull_rows  token s sums (score *) y[slots[s, j]] over j in fp32: gather forward, scatter backward
// A warp owns a token and moves its row in 16-byte vectors (push: a thread owns a token where rows
// are a few elements wide, as row_scores' one column, whose warp per token left 31 lanes idle and
// took ~10x the time). Buffer rows no route reaches are zeroed by extra blocks of the push kernel,
// found from the kept counts. With RENORM the weights
// are the kept scores over their sum (reference.renormalize_kept), formed per token in registers,
// and gather's backward turns the dot products into gradients of the raw scores.
#include "common.cuh"

namespace turbomoe {

constexpr int ZERO_ROWS_PER_WARP = 8;  // per group of LANES threads
constexpr int64_t NARROW_ROW = 8;      // rows narrower than this elements: one thread a token

// This warp's token's k slots (-1 where no valid row) and weights: the scores, or with RENORM the
// kept scores over max(their sum, eps). Returns that denominator (1 without RENORM); *clamped says
// whether eps replaced the sum, where the weights no longer depend on each other.
template <typename acc_t, bool HAS_SCORES, bool RENORM>
__device__ __forceinline__ acc_t load_routes(const int32_t* __restrict__ slots, const acc_t* __restrict__ scores,
                                             int64_t s, int K, int64_t R, int64_t (&slot)[MAX_K],
                                             acc_t (&score)[MAX_K], bool* clamped = nullptr) {
  acc_t sum = 0;
#pragma unroll
  for (int j = 0; j < MAX_K; ++j) {
    slot[j] = -1;
    score[j] = acc_t(1);
    if (j < K) {
      const int64_t v = slots[s * K + j];
      slot[j] = (v >= 0 && v < R) ? v : -1;
      if (HAS_SCORES) score[j] = scores[s * K + j];
      if (RENORM && slot[j] >= 0) sum += score[j];
    }
  }
  if (!RENORM) return acc_t(1);
  const acc_t eps = std::numeric_limits<acc_t>::epsilon();
  // As the reference's clamp_min: a NaN sum stays NaN (NaN weights and gradients), not eps
  if (clamped) *clamped = sum < eps;
  const acc_t denom = sum < eps ? eps : sum;
#pragma unroll
  for (int j = 0; j < MAX_K; ++j) score[j] = slot[j] >= 0 ? score[j] / denom : acc_t(0);
  return denom;
}

template <typename scalar_t, typename acc_t, int VEC, bool HAS_SCORES, bool DOT, bool RENORM, int LANES>
__global__ void __launch_bounds__(BLOCK_THREADS)
push_rows_kernel(const scalar_t* __restrict__ src, const int32_t* __restrict__ slots, const acc_t* __restrict__ scores,
                 const scalar_t* __restrict__ y, const int32_t* __restrict__ kept, scalar_t* __restrict__ out,
                 acc_t* __restrict__ dscores, int64_t S, int64_t M, int64_t R, int K, int64_t token_blocks, int C, int E) {
  using V = Vec<scalar_t, VEC>;
  constexpr int GROUPS = BLOCK_THREADS / LANES;  // tokens (or runs of empty rows) a block
  const int lane = threadIdx.x % LANES, group = threadIdx.x / LANES;
  const int64_t nvec = M / VEC;
  if (blockIdx.x < token_blocks) {
    const int64_t s = blockIdx.x * GROUPS + group;
    if (s >= S) return;
    int64_t slot[MAX_K];
    acc_t score[MAX_K], dot[MAX_K];
    bool clamped = false;
    const acc_t denom = load_routes<acc_t, HAS_SCORES, RENORM>(slots, scores, s, K, R, slot, score, &clamped);
#pragma unroll
    for (int j = 0; j < MAX_K; ++j) dot[j] = 0;
    const V* src_row = reinterpret_cast<const V*>(src + s * M);
    for (int64_t v = lane; v < nvec; v += LANES) {
      const V a = src_row[v];
#pragma unroll
      for (int j = 0; j < MAX_K; ++j) {
        if (j >= K || slot[j] < 0) continue;
        V o;
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          o.v[q] = HAS_SCORES ? static_cast<scalar_t>(static_cast<acc_t>(a.v[q]) * score[j]) : a.v[q];
        }
        reinterpret_cast<V*>(out + slot[j] * M)[v] = o;
        if (DOT) {
          const V b = reinterpret_cast<const V*>(y + slot[j] * M)[v];
#pragma unroll
          for (int q = 0; q < VEC; ++q) dot[j] += static_cast<acc_t>(a.v[q]) * static_cast<acc_t>(b.v[q]);
        }
      }
    }
    if constexpr (DOT && !RENORM) {  // d_j = <grad_out, y_j>, reduced and stored one j at a time
#pragma unroll
      for (int j = 0; j < MAX_K; ++j) {
        if (j < K) {
          const acc_t d = lanes_sum<LANES>(dot[j]);
          if (lane == 0) dscores[s * K + j] = d;
        }
      }
    } else if constexpr (DOT) {
      // w_j = p_j / D over the kept routes, so dL/dp_j = (d_j - sum_i w_i d_i) / D, or d_j / eps
      // where eps replaced D. (Kept apart from the plain case: holding every d_j costs registers,
      // and 94 instead of 80 per thread cut plain gather's backward from 77% to 70% of copy.)
      acc_t wd = 0;
#pragma unroll
      for (int j = 0; j < MAX_K; ++j) {
        if (j < K) {
          dot[j] = lanes_sum<LANES>(dot[j]);
          wd += score[j] * dot[j];
        }
      }
#pragma unroll
      for (int j = 0; j < MAX_K; ++j) {
        if (j < K && lane == 0) dscores[s * K + j] = slot[j] < 0 ? acc_t(0) : (dot[j] - (clamped ? acc_t(0) : wd)) / denom;
      }
    }
    return;
  }
  // Empty rows: capacity C > 0, rows e*C + p with p >= kept[e]; dropless (C = 0), rows past the
  // sum of the kept counts.
  int64_t total = 0;
  if (C == 0) {
    for (int e = lane; e < E; e += LANES) total += kept[e];
    total = lanes_sum<LANES>(total);
  }
  V zero;
#pragma unroll
  for (int q = 0; q < VEC; ++q) zero.v[q] = static_cast<scalar_t>(0);
  const int64_t row0 = ((blockIdx.x - token_blocks) * GROUPS + group) * ZERO_ROWS_PER_WARP;
  for (int64_t r = row0; r < min(R, row0 + ZERO_ROWS_PER_WARP); ++r) {
    const bool empty = C > 0 ? (r % C) >= kept[r / C] : r >= total;
    if (!empty) continue;
    V* row = reinterpret_cast<V*>(out + r * M);
    for (int64_t v = lane; v < nvec; v += LANES) row[v] = zero;
  }
}

template <typename scalar_t, typename acc_t, int VEC, bool HAS_SCORES, bool RENORM>
__global__ void __launch_bounds__(BLOCK_THREADS)
pull_rows_kernel(const scalar_t* __restrict__ y, const int32_t* __restrict__ slots, const acc_t* __restrict__ scores,
                 scalar_t* __restrict__ out, int64_t S, int64_t M, int64_t R, int K) {
  using V = Vec<scalar_t, VEC>;
  const int lane = threadIdx.x % WARP;
  const int64_t s = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP;
  if (s >= S) return;
  int64_t slot[MAX_K];
  acc_t score[MAX_K];
  load_routes<acc_t, HAS_SCORES, RENORM>(slots, scores, s, K, R, slot, score);
  V* out_row = reinterpret_cast<V*>(out + s * M);
  for (int64_t v = lane; v < M / VEC; v += WARP) {
    acc_t acc[VEC];
#pragma unroll
    for (int q = 0; q < VEC; ++q) acc[q] = 0;
#pragma unroll
    for (int j = 0; j < MAX_K; ++j) {
      if (j >= K || slot[j] < 0) continue;
      const V b = reinterpret_cast<const V*>(y + slot[j] * M)[v];
#pragma unroll
      for (int q = 0; q < VEC; ++q) {
        acc[q] += HAS_SCORES ? static_cast<acc_t>(b.v[q]) * score[j] : static_cast<acc_t>(b.v[q]);
      }
    }
    V o;
#pragma unroll
    for (int q = 0; q < VEC; ++q) o.v[q] = static_cast<scalar_t>(acc[q]);
    out_row[v] = o;
  }
}

namespace {

// 16-byte vectors where the rows allow them, else one element at a time.
template <typename scalar_t, typename F>
void dispatch_vec(int64_t M, std::initializer_list<const at::Tensor*> tensors, F&& f) {
  constexpr int VEC16 = 16 / sizeof(scalar_t);
  bool vec = M % VEC16 == 0;
  for (const at::Tensor* t : tensors) vec = vec && (t == nullptr || aligned16(*t));
  if (vec) f(std::integral_constant<int, VEC16>());
  else f(std::integral_constant<int, 1>());
}

void check_slots(const at::Tensor& slots) {
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.is_contiguous() && slots.size(1) <= MAX_K, "slots: int32 [S, k]");
}

}  // namespace

void push_rows(const at::Tensor& src, const at::Tensor& slots, at::Tensor& out, const c10::optional<at::Tensor>& kept,
               int64_t capacity, const c10::optional<at::Tensor>& scores, const c10::optional<at::Tensor>& y,
               const c10::optional<at::Tensor>& dscores, bool renorm) {
  check_2d(src, "src");
  check_2d(out, "out");
  check_slots(slots);
  TORCH_CHECK(!renorm || scores.has_value(), "push_rows: renorm needs scores");
  const c10::cuda::CUDAGuard guard(src.device());
  const int64_t S = src.size(0), M = src.size(1), R = out.size(0);
  const int K = slots.size(1);
  if (!kept.has_value()) out.zero_();  // bare slots: no counts to find the empty rows from
  if (M == 0 || S + R == 0) {
    if (dscores.has_value()) dscores->zero_();
    return;
  }
  const int E = kept.has_value() ? kept->numel() : 0;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "turbomoe_push_rows", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const acc_t* sc = scores.has_value() ? scores->data_ptr<acc_t>() : nullptr;
    const scalar_t* y_ptr = y.has_value() ? y->data_ptr<scalar_t>() : nullptr;
    acc_t* ds = dscores.has_value() ? dscores->data_ptr<acc_t>() : nullptr;
    const int32_t* kept_ptr = kept.has_value() ? kept->data_ptr<int32_t>() : nullptr;
    dispatch_vec<scalar_t>(M, {&src, &out, y.has_value() ? &y.value() : nullptr}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      auto with_lanes = [&](auto lanes) {
        constexpr int LANES = decltype(lanes)::value, GROUPS = BLOCK_THREADS / LANES;
        const int64_t token_blocks = cdiv(S, GROUPS);
        const int64_t zero_blocks = kept.has_value() ? cdiv(R, GROUPS * ZERO_ROWS_PER_WARP) : 0;
        auto launch = [&](auto kernel) {
          kernel<<<token_blocks + zero_blocks, BLOCK_THREADS, 0, stream>>>(
              src.data_ptr<scalar_t>(), slots.data_ptr<int32_t>(), sc, y_ptr, kept_ptr, out.data_ptr<scalar_t>(), ds,
              S, M, R, K, token_blocks, static_cast<int>(capacity), E);
        };
        // On has_value(), not the pointers: an empty y (every route dropped) has a null data pointer,
        // and its grad scores must still be written (zeros).
        if (y.has_value() && renorm) launch(push_rows_kernel<scalar_t, acc_t, VEC, true, true, true, LANES>);
        else if (y.has_value()) launch(push_rows_kernel<scalar_t, acc_t, VEC, true, true, false, LANES>);
        else if (renorm) launch(push_rows_kernel<scalar_t, acc_t, VEC, true, false, true, LANES>);  // row_scores
        else if (scores.has_value()) launch(push_rows_kernel<scalar_t, acc_t, VEC, true, false, false, LANES>);
        else launch(push_rows_kernel<scalar_t, acc_t, VEC, false, false, false, LANES>);
      };
      if constexpr (VEC == 1) {  // (a narrow row of 16-byte vectors, fp32's 4, keeps its warp)
        if (M < NARROW_ROW) return with_lanes(std::integral_constant<int, 1>());
      }
      with_lanes(std::integral_constant<int, WARP>());
    });
    TURBOMOE_CHECK_LAUNCH();
  });
}

void pull_rows(const at::Tensor& y, const at::Tensor& slots, at::Tensor& out, const c10::optional<at::Tensor>& scores,
               bool renorm) {
  check_2d(y, "y");
  check_2d(out, "out");
  check_slots(slots);
  TORCH_CHECK(!renorm || scores.has_value(), "pull_rows: renorm needs scores");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t S = out.size(0), M = out.size(1), R = y.size(0);
  const int K = slots.size(1);
  if (S == 0 || M == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "turbomoe_pull_rows", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const acc_t* sc = scores.has_value() ? scores->data_ptr<acc_t>() : nullptr;
    dispatch_vec<scalar_t>(M, {&y, &out}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      auto launch = [&](auto kernel) {
        kernel<<<cdiv(S, WARPS_PER_BLOCK), BLOCK_THREADS, 0, stream>>>(y.data_ptr<scalar_t>(), slots.data_ptr<int32_t>(),
                                                                       sc, out.data_ptr<scalar_t>(), S, M, R, K);
      };
      if (scores.has_value() && renorm) launch(pull_rows_kernel<scalar_t, acc_t, VEC, true, true>);
      else if (scores.has_value()) launch(pull_rows_kernel<scalar_t, acc_t, VEC, true, false>);
      else launch(pull_rows_kernel<scalar_t, acc_t, VEC, false, false>);
    });
    TURBOMOE_CHECK_LAUNCH();
  });
}

}  // namespace turbomoe
