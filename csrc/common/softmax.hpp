// Online softmax on register fragments (arch-independent: works on any "row x col" view).
//
// Each thread owns kRows rows of the score tile; the columns of one row are spread over
// kThreadsPerRow consecutive lanes (4 for both WGMMA and mma.sync accumulators), so row
// reductions are a local loop plus a butterfly over those lanes.
//
// Scores are kept unscaled; exponentials are exp2(s * scale_log2 - max * scale_log2), one FFMA and one
// MUFU.EX2 per element, with scale_log2 = softmax_scale * log2(e).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace flash4 {

// ex2.approx has 2 ulp error (well under bf16/fp16 rounding) and is one MUFU op; exp2f() without
// --use_fast_math is a multi-instruction sequence.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int kThreadsPerRow>
__device__ __forceinline__ float allreduce_max(float x) {
#pragma unroll
  for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

template <int kThreadsPerRow>
__device__ __forceinline__ float allreduce_sum(float x) {
#pragma unroll
  for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

template <int kRows, int kThreadsPerRow = 4>
struct OnlineSoftmax {
  cute::array<float, kRows> row_max;  // running max of the raw (unscaled) scores, -inf if none seen
  cute::array<float, kRows> row_sum;  // this thread's partial sum of exp; reduced over the row at the end
  float scale_log2;

  __device__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Turns the scores S (rowcol view, kRows x cols, fp32) into unnormalized probabilities in place and
  // returns, per row, the factor by which the output accumulated so far must be rescaled.
  // kFirst: no earlier tile, so nothing to rescale.
  template <bool kFirst, class TensorS>
  __device__ __forceinline__ cute::array<float, kRows> update(TensorS& s) {
    static_assert(decltype(cute::size<0>(s))::value == kRows);
    cute::array<float, kRows> o_scale;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) m = fmaxf(m, s(r, c));
      m = allreduce_max<kThreadsPerRow>(m);
      // A row that has seen only masked keys keeps max = -inf; use 0 as its offset so that
      // exp2(-inf - offset) = 0 rather than exp2(-inf + inf) = NaN.
      const float m_scaled = (m == -INFINITY) ? 0.f : m * scale_log2;
      if constexpr (kFirst) {
        o_scale[r] = 1.f;
      } else {
        // row_max[r] == -inf (nothing seen yet) gives exp2(-inf) = 0: the accumulator is zero anyway.
        o_scale[r] = exp2_approx(row_max[r] * scale_log2 - m_scaled);
        row_sum[r] *= o_scale[r];
      }
      row_max[r] = m;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) {
        s(r, c) = exp2_approx(fmaf(s(r, c), scale_log2, -m_scaled));
        sum += s(r, c);
      }
      row_sum[r] += sum;
    }
    return o_scale;
  }

  // update<false> that keeps the running maxima while no row of the warp has grown by more than
  // kLazyRescaleLog2 (in exp2 units) since they were set, so the output need not be rescaled: returns false
  // and leaves o_scale alone. The probabilities are then exp2(s * scale - stale max) <= 2^kLazyRescaleLog2
  // (fp32 sums and bf16 / fp16 P hold that exactly as well as values <= 1), and the final normalisation and
  // LSE use the same stale maxima, so the result is the same softmax. Returns true (o_scale filled, maxima
  // moved) when some row of the warp grew by more, or first saw a key; the decision is warp-uniform so the
  // caller's rescale is a branch the whole warp takes or skips.
  static constexpr float kLazyRescaleLog2 = 8.f;
  template <class TensorS>
  __device__ __forceinline__ bool update_lazy(TensorS& s, cute::array<float, kRows>& o_scale) {
    static_assert(decltype(cute::size<0>(s))::value == kRows);
    cute::array<float, kRows> m_new;
    bool grow = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) m = fmaxf(m, s(r, c));
      m_new[r] = allreduce_max<kThreadsPerRow>(m);
      // -inf -> finite is +inf > threshold; -inf -> -inf is NaN, not > threshold (nothing to rescale).
      grow |= (m_new[r] - row_max[r]) * scale_log2 > kLazyRescaleLog2;
    }
    const bool rescale = __any_sync(0xffffffffu, grow);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (rescale) {
        const float m_scaled = (m_new[r] == -INFINITY) ? 0.f : m_new[r] * scale_log2;
        o_scale[r] = exp2_approx(row_max[r] * scale_log2 - m_scaled);
        row_sum[r] *= o_scale[r];
        row_max[r] = m_new[r];
      }
      const float m_scaled = (row_max[r] == -INFINITY) ? 0.f : row_max[r] * scale_log2;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) {
        s(r, c) = exp2_approx(fmaf(s(r, c), scale_log2, -m_scaled));
        sum += s(r, c);
      }
      row_sum[r] += sum;
    }
    return rescale;
  }

  // Multiplies each row of the output accumulator (rowcol view) by its factor.
  template <class TensorO>
  __device__ __forceinline__ static void rescale(TensorO& o, cute::array<float, kRows> const& scale) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < cute::size<1>(o); ++c) o(r, c) *= scale[r];
    }
  }

  // Finishes the row sums; returns per row the factor that normalizes the output (0 for a row that saw
  // no key, so its output is 0, not NaN) and writes the natural-log LSE (-inf for such rows).
  __device__ __forceinline__ cute::array<float, kRows> finalize(float softmax_scale,
                                                               cute::array<float, kRows>& lse) {
    cute::array<float, kRows> inv;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = allreduce_sum<kThreadsPerRow>(row_sum[r]);
      const bool empty = (sum == 0.f) || (sum != sum);
      inv[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + logf(sum);
    }
    return inv;
  }
};

}  // namespace flash4
