// topk_gating in CUDA: logits [S, E] -> top-k ids [S, k], scores [S, k], counts [E], aux and z.
//
// One warp owns a row; lane l holds columns l, l + 32, ... (CPL of them), so a row's softmax, top-k
// and backward are warp shuffles. Up to 16 experts one thread owns a row instead (all its columns in
// registers, no shuffles): a warp a row ran its 32k-token forward and backward at 17 and 19 us on an
// H100, latency-bound waves of blocks, for 2 MB of logits. Sums across rows (counts, the aux and z
// losses) are per-block partials [4, E], each block adding its warps in warp order (a thread-a-row
// warp first sums its 32 rows by butterfly), and one block sums the partials in block order:
// deterministic, two launches for the forward. Same layout of partials as the Triton kernels
// (turbomoe/kernels/gating.py).
#include "topk.cuh"

namespace turbomoe {

// LANES threads own a row: a warp (CPL columns a lane) or one thread (CPL >= E, E <= 16).
template <typename scalar_t, typename acc_t, int CPL, int LANES>
__global__ void __launch_bounds__(BLOCK_THREADS)
gating_fwd_kernel(const scalar_t* __restrict__ logits, const acc_t* __restrict__ bias, int32_t* __restrict__ ids,
                  acc_t* __restrict__ scores, acc_t* __restrict__ lse_out, acc_t* __restrict__ partials, int S, int E,
                  int k, int rows_per_block, bool sigmoid, bool renorm) {
  extern __shared__ unsigned char smem_raw[];
  acc_t* block_part = reinterpret_cast<acc_t*>(smem_raw);  // [3, E]: prob sums, routes, first choices
  constexpr int GROUPS = BLOCK_THREADS / LANES;  // rows a block works on at once
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % LANES, group = threadIdx.x / LANES;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  acc_t psum[CPL], routes[CPL], firsts[CPL];
#pragma unroll
  for (int i = 0; i < CPL; ++i) psum[i] = routes[i] = firsts[i] = 0;
  acc_t zsum = 0;

  const int row_end = min(S, (blockIdx.x + 1) * rows_per_block);
  for (int row = blockIdx.x * rows_per_block + group; row < row_end; row += GROUPS) {
    acc_t probs[CPL], softmax[CPL];
    const RowProbs<acc_t> rp = row_probs<scalar_t, acc_t, CPL, LANES>(logits, row, E, sigmoid, probs, softmax);
    if (lane == 0) lse_out[row] = rp.lse;
    zsum += rp.lse * rp.lse;
    int id[MAX_K];  // a warp's lane j < k keeps choice j in [0]; a thread keeps choice j in [j]
    acc_t score[MAX_K];
#pragma unroll
    for (int q = 0; q < MAX_K; ++q) {
      id[q] = -1;
      score[q] = 0;
    }
    if (rp.valid) {
      acc_t sel[CPL];
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        const int c = lane + LANES * i;
        psum[i] += probs[i];
        sel[i] = c < E ? probs[i] + (bias ? bias[c] : acc_t(0)) : neg_inf;
        sel[i] = isnan(sel[i]) ? neg_inf : sel[i];  // a NaN bias ranks as -inf, as in the reference
      }
      const unsigned chosen = row_topk<acc_t, CPL, LANES>(sel, probs, E, k, renorm, id, score);
      int first = id[0];  // choice 0: the thread's, or lane 0's
      if constexpr (LANES == WARP) first = __shfl_sync(FULL_MASK, first, 0);
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        if ((chosen >> i) & 1u) routes[i] += 1;
        if (lane + LANES * i == first) firsts[i] += 1;
      }
    }
    if constexpr (LANES == 1) {
#pragma unroll
      for (int q = 0; q < MAX_K; ++q) {
        if (q < k) {
          ids[int64_t(row) * k + q] = id[q];
          scores[int64_t(row) * k + q] = score[q];
        }
      }
    } else if (lane < k) {
      ids[int64_t(row) * k + lane] = id[0];
      scores[int64_t(row) * k + lane] = score[0];
    }
  }

  // A thread-a-row warp's 32 threads hold the same columns: their sums, by butterfly, go to lane c
  // for column c (CPL <= 16 < 32), so that every warp hands on one column a lane, as a warp a row does.
  constexpr int HELD = LANES == 1 ? 1 : CPL;  // columns a lane hands on: lane + WARP * i
  acc_t p_out[HELD], r_out[HELD], f_out[HELD];
  const int wl = threadIdx.x % WARP;
  if constexpr (LANES == 1) {
    p_out[0] = r_out[0] = f_out[0] = 0;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const acc_t p = warp_sum(psum[i]), r = warp_sum(routes[i]), f = warp_sum(firsts[i]);
      if (wl == i) {
        p_out[0] = p;
        r_out[0] = r;
        f_out[0] = f;
      }
    }
    zsum = warp_sum(zsum);
  } else {
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      p_out[i] = psum[i];
      r_out[i] = routes[i];
      f_out[i] = firsts[i];
    }
  }
  // Warps add their partials into shared memory one after another: a fixed order.
  for (int w = 0; w < WARPS_PER_BLOCK; ++w) {
    if (warp == w) {
#pragma unroll
      for (int i = 0; i < HELD; ++i) {
        const int c = wl + WARP * i;
        if (c < E) {
          block_part[c] = (w ? block_part[c] : acc_t(0)) + p_out[i];
          block_part[E + c] = (w ? block_part[E + c] : acc_t(0)) + r_out[i];
          block_part[2 * E + c] = (w ? block_part[2 * E + c] : acc_t(0)) + f_out[i];
        }
      }
      if (wl == 0) block_part[3 * E] = (w ? block_part[3 * E] : acc_t(0)) + zsum;
    }
    __syncthreads();
  }
  acc_t* out = partials + int64_t(blockIdx.x) * 4 * E;
  for (int c = threadIdx.x; c <= 3 * E; c += BLOCK_THREADS) out[c] = block_part[c];
}

// One block of 32 x 32 threads: column tiles of 32, blocks strided over the 32 rows of threads,
// then the 32 row sums added in row order.
template <typename acc_t>
__global__ void __launch_bounds__(1024)
gating_stats_kernel(const acc_t* __restrict__ partials, int32_t* __restrict__ counts, acc_t* __restrict__ stats,
                    int nblocks, int S, int E, acc_t coef, bool first_only) {
  __shared__ acc_t tile[3][32][33];
  __shared__ acc_t aux_terms[MAX_EXPERTS];
  __shared__ acc_t zrow[32];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t stride = 4 * int64_t(E);
  for (int c0 = 0; c0 < E; c0 += 32) {
    const int c = c0 + tx;
    acc_t p = 0, n = 0, f = 0;
    if (c < E) {
      for (int b = ty; b < nblocks; b += 32) {
        p += partials[b * stride + c];
        n += partials[b * stride + E + c];
        f += partials[b * stride + 2 * E + c];
      }
    }
    tile[0][ty][tx] = p;
    tile[1][ty][tx] = n;
    tile[2][ty][tx] = f;
    __syncthreads();
    if (ty == 0 && c < E) {
      p = n = f = 0;
      for (int r = 0; r < 32; ++r) {
        p += tile[0][r][tx];
        n += tile[1][r][tx];
        f += tile[2][r][tx];
      }
      const acc_t ce = (first_only ? f : n) / S;
      counts[c] = static_cast<int32_t>(n);
      stats[c] = ce;
      aux_terms[c] = p / S * ce;
    }
    __syncthreads();
  }
  if (tx == 0) {
    acc_t z = 0;
    for (int b = ty; b < nblocks; b += 32) z += partials[b * stride + 3 * E];
    zrow[ty] = z;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    acc_t aux = 0, z = 0;
    for (int c = 0; c < E; ++c) aux += aux_terms[c];
    for (int r = 0; r < 32; ++r) z += zrow[r];
    stats[E] = coef * aux;
    stats[E + 1] = z / S;
  }
}

template <typename scalar_t, typename acc_t, int CPL, int LANES>
__global__ void __launch_bounds__(BLOCK_THREADS)
gating_bwd_kernel(const scalar_t* __restrict__ logits, const int32_t* __restrict__ ids,
                  const acc_t* __restrict__ grad_scores, const acc_t* __restrict__ ce,
                  const acc_t* __restrict__ g_aux, const acc_t* __restrict__ g_z, scalar_t* __restrict__ grad,
                  int S, int E, int k, acc_t coef, bool sigmoid, bool renorm) {
  const int lane = threadIdx.x % LANES;
  const int row = blockIdx.x * (BLOCK_THREADS / LANES) + threadIdx.x / LANES;
  if (row >= S) return;  // a whole warp (or the row's thread) leaves together
  acc_t probs[CPL], softmax[CPL];
  const RowProbs<acc_t> rp = row_probs<scalar_t, acc_t, CPL, LANES>(logits, row, E, sigmoid, probs, softmax);
  acc_t grad_p[CPL], direct[CPL];  // direct: terms already taken through d probs / d logits
  // The aux term d/dp_se of coef * sum_e (sum_s p_se / S) * ce_e, scaled by 1/S before any sum.
  const acc_t aux_scale = g_aux ? *g_aux * coef / S : acc_t(0);
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + LANES * i;
    grad_p[i] = (g_aux && c < E) ? aux_scale * ce[c] : acc_t(0);
    direct[i] = 0;
  }
  if (grad_scores && rp.valid) {
    acc_t g[MAX_K], r[MAX_K];
    int e[MAX_K];
    acc_t denom = 0;
#pragma unroll
    for (int j = 0; j < MAX_K; ++j) {
      g[j] = r[j] = 0;
      e[j] = -1;
      if (j < k) {
        g[j] = grad_scores[int64_t(row) * k + j];
        e[j] = ids[int64_t(row) * k + j];
        r[j] = e[j] >= 0 ? column_value<acc_t, CPL, LANES>(probs, e[j]) : acc_t(0);
        denom += r[j];
      }
    }
    denom = denom > 0 ? denom : acc_t(1);
    // With renorm, score_i = s_i = r_i / D, taken through the logits directly: d/dl_i =
    // s_i (g_i - sum_j s_j g_j), times (1 - r_i) for sigmoid; never r / D^2, whose D^2 underflows
    // (NaN) when the bias steers the choice to experts of tiny probability. Exactly 0 for k = 1.
    acc_t sg = 0;
#pragma unroll
    for (int j = 0; j < MAX_K; ++j) {
      if (renorm && j < k) sg += r[j] / denom * g[j];
    }
    acc_t d[MAX_K];  // choice j's term: through the logits directly (renorm), or into its prob's gradient
#pragma unroll
    for (int j = 0; j < MAX_K; ++j) {
      d[j] = renorm ? r[j] / denom * (g[j] - sg) : g[j];
      if (renorm && sigmoid) d[j] *= acc_t(1) - r[j];
    }
    // Each held column takes the term of the choice that names it (at most one: the k are distinct),
    // compared column by column: a choice-indexed register write became local memory (ptxas).
#pragma unroll
    for (int q = 0; q < CPL; ++q) {
      const int c = lane + LANES * q;
#pragma unroll
      for (int j = 0; j < MAX_K; ++j) {
        if (j < k && e[j] == c) {
          if (renorm) direct[q] += d[j];
          else grad_p[q] += d[j];
        }
      }
    }
  }
  acc_t dot = 0;
  if (!sigmoid) {
#pragma unroll
    for (int i = 0; i < CPL; ++i) dot += probs[i] * grad_p[i];
    dot = lanes_sum<LANES>(dot);
  }
  // z-loss = sum_s lse_s^2 / S: d/dlogits = (2 / S) * lse * softmax.
  const acc_t z_scale = g_z ? *g_z * acc_t(2) / S * rp.lse : acc_t(0);
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + LANES * i;
    if (c < E) {
      acc_t gl = sigmoid ? grad_p[i] * probs[i] * (acc_t(1) - probs[i]) : probs[i] * (grad_p[i] - dot);
      gl += z_scale * softmax[i] + direct[i];
      grad[int64_t(row) * E + c] = static_cast<scalar_t>(rp.valid ? gl : acc_t(0));
    }
  }
}

// Returns ids [S, k] int32, scores [S, k], counts [E] int32, ce [E], aux and z (0-d), lse [S].
std::vector<at::Tensor> gating_forward(const at::Tensor& logits, int64_t k, bool sigmoid, bool renorm,
                                       const c10::optional<at::Tensor>& bias, double coef) {
  check_2d(logits, "logits");
  const int S = logits.size(0), E = logits.size(1);
  TORCH_CHECK(E >= 1 && E <= MAX_EXPERTS && k >= 1 && k <= std::min(E, MAX_K), "gating: bad E or k");
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto opts = logits.options();
  // At most 512 blocks of partials, each a whole number of the block's rows at once.
  const int groups = BLOCK_THREADS / row_lanes(E);
  const int rows_per_block = std::max<int>(groups, cdiv(cdiv(S, 512), groups) * groups);
  const int nblocks = std::max<int>(1, cdiv(S, rows_per_block));
  at::Tensor ids = at::empty({S, k}, opts.dtype(at::kInt));
  at::Tensor scores = at::empty({S, k}, opts.dtype(acc));
  at::Tensor lse = at::empty({S}, opts.dtype(acc));
  at::Tensor partials = at::empty({nblocks, 4, E}, opts.dtype(acc));
  at::Tensor counts = at::empty({E}, opts.dtype(at::kInt));
  at::Tensor stats = at::empty({E + 2}, opts.dtype(acc));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "turbomoe_gating_fwd", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const acc_t* bias_ptr = nullptr;
    if (bias.has_value()) {
      TORCH_CHECK(bias->scalar_type() == acc && bias->is_contiguous() && bias->numel() == E, "bias: [E] in acc dtype");
      bias_ptr = bias->data_ptr<acc_t>();
    }
    if (S > 0) {
      TURBOMOE_DISPATCH_ROW(E, [&] {
        gating_fwd_kernel<scalar_t, acc_t, CPL, LANES><<<nblocks, BLOCK_THREADS, (3 * E + 1) * sizeof(acc_t), stream>>>(
            logits.data_ptr<scalar_t>(), bias_ptr, ids.data_ptr<int32_t>(), scores.data_ptr<acc_t>(),
            lse.data_ptr<acc_t>(), partials.data_ptr<acc_t>(), S, E, k, rows_per_block, sigmoid, renorm);
      });
      TURBOMOE_CHECK_LAUNCH();
    } else {
      partials.zero_();
    }
    gating_stats_kernel<acc_t><<<1, 1024, 0, stream>>>(partials.data_ptr<acc_t>(), counts.data_ptr<int32_t>(),
                                                       stats.data_ptr<acc_t>(), nblocks, std::max(S, 1), E,
                                                       static_cast<acc_t>(coef), k <= 2);
    TURBOMOE_CHECK_LAUNCH();
  });
  return {ids, scores, counts, stats.narrow(0, 0, E), stats.select(0, E), stats.select(0, E + 1), lse};
}

at::Tensor gating_backward(const at::Tensor& logits, const at::Tensor& ids, const c10::optional<at::Tensor>& grad_scores,
                           const at::Tensor& ce, const c10::optional<at::Tensor>& g_aux,
                           const c10::optional<at::Tensor>& g_z, bool sigmoid, bool renorm, double coef) {
  check_2d(logits, "logits");
  const int S = logits.size(0), E = logits.size(1), k = ids.size(1);
  TORCH_CHECK(E <= MAX_EXPERTS && k <= MAX_K && ids.scalar_type() == at::kInt && ids.is_contiguous(), "gating bwd");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad = at::empty_like(logits);
  if (S == 0) return grad;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "turbomoe_gating_bwd", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    auto ptr = [](const c10::optional<at::Tensor>& t) -> const acc_t* {
      return t.has_value() ? t->data_ptr<acc_t>() : nullptr;
    };
    TURBOMOE_DISPATCH_ROW(E, [&] {
      gating_bwd_kernel<scalar_t, acc_t, CPL, LANES><<<cdiv(S, BLOCK_THREADS / LANES), BLOCK_THREADS, 0, stream>>>(
          logits.data_ptr<scalar_t>(), ids.data_ptr<int32_t>(), ptr(grad_scores), ce.data_ptr<acc_t>(), ptr(g_aux),
          ptr(g_z), grad.data_ptr<scalar_t>(), S, E, k, static_cast<acc_t>(coef), sigmoid, renorm);
    });
    TURBOMOE_CHECK_LAUNCH();
  });
  return grad;
}

}  // namespace turbomoe
