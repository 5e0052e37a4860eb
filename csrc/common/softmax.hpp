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
#include <type_traits>

#include "fast_math.hpp"

namespace flash4 {

template <int kThreadsPerRow>
__device__ __forceinline__ float allreduce_max(float x) {
#pragma unroll
  for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// Per-row offsets of a score tile: its true scores are s(r, c) + off[r] (a score bias split into a part added
// to the elements and a part per row, common/score_bias.hpp). NoRowOffset: none, at no cost.
struct NoRowOffset {};

template <int kThreadsPerRow>
__device__ __forceinline__ float allreduce_sum(float x) {
#pragma unroll
  for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// kExpShift: probabilities come out as exp2(kExpShift) * p (the fp8 kernels: P in e4m3 keeps 3 mantissa bits
// from 2^-6 up, and 2^7 * p moves small probabilities out of its subnormals while staying under its 448
// maximum). Row sums carry the same factor, so the normalized output does not change; finalize takes it out
// of the LSE.
template <int kRows, int kThreadsPerRow = 4, int kExpShift = 0>
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

  // Max of row r over the running max and this tile's scores (plus the row's offset), reduced over the row's
  // lanes.
  template <class TensorS, class Off = NoRowOffset>
  __device__ __forceinline__ float tile_row_max(TensorS const& s, int r, Off const& off = {}) const {
    if constexpr (std::is_same_v<Off, NoRowOffset>) {
      float m = row_max[r];
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) m = fmaxf(m, s(r, c));
      return allreduce_max<kThreadsPerRow>(m);
    } else {
      // The offset is per lane (each lane's scores are relative to its own first column): added before the
      // reduction.
      float m = -INFINITY;
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) m = fmaxf(m, s(r, c));
      return fmaxf(row_max[r], allreduce_max<kThreadsPerRow>(m + off[r]));
    }
  }

  // The exponent offset for a row max m: m * scale_log2, or 0 for a row that has seen only masked keys
  // (m = -inf), so that exp2(-inf - offset) = 0 rather than exp2(-inf + inf) = NaN.
  __device__ __forceinline__ float max_offset(float m) const {
    return m == -INFINITY ? 0.f : m * scale_log2 - float(kExpShift);
  }

  // Moves row r's running max to m (offset m_scaled) and returns the factor for what was accumulated under
  // the old one (the row sum is rescaled here). An old max of -inf (nothing seen yet) gives 0: the
  // accumulator is zero anyway.
  __device__ __forceinline__ float move_max(int r, float m, float m_scaled) {
    const float scale = exp2_approx(row_max[r] * scale_log2 - float(kExpShift) - m_scaled);
    row_sum[r] *= scale;
    row_max[r] = m;
    return scale;
  }

  // Row r's scores -> exp2(s * scale_log2 - m_scaled) in place, added into the row sum. With a row offset the
  // exponent is (s + off - m) * scale_log2: the offset moves into the row's constant, far from the elements'
  // precision only where the exponential underflows anyway.
  template <class TensorS, class Off = NoRowOffset>
  __device__ __forceinline__ void exponentiate_row(TensorS& s, int r, float m_scaled, Off const& off = {}) {
    if constexpr (!std::is_same_v<Off, NoRowOffset>) m_scaled -= off[r] * scale_log2;
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < cute::size<1>(s); ++c) {
      s(r, c) = exp2_approx(fmaf(s(r, c), scale_log2, -m_scaled));
      sum += s(r, c);
    }
    row_sum[r] += sum;
  }

  // Turns the scores S (rowcol view, kRows x cols, fp32) into unnormalized probabilities in place and
  // returns, per row, the factor by which the output accumulated so far must be rescaled.
  // kFirst: no earlier tile, so nothing to rescale.
  // `off`: per-row offsets of the tile (NoRowOffset: none).
  template <bool kFirst, class TensorS, class Off = NoRowOffset>
  __device__ __forceinline__ cute::array<float, kRows> update(TensorS& s, Off const& off = {}) {
    static_assert(decltype(cute::size<0>(s))::value == kRows);
    cute::array<float, kRows> o_scale;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float m = tile_row_max(s, r, off);
      const float m_scaled = max_offset(m);
      if constexpr (kFirst) {
        o_scale[r] = 1.f;
        row_max[r] = m;
      } else {
        o_scale[r] = move_max(r, m, m_scaled);
      }
      exponentiate_row(s, r, m_scaled, off);
    }
    return o_scale;
  }

  // update<false> that keeps the running maxima while no row of the warp has grown since they were set, so the
  // output need not be rescaled: returns false and leaves o_scale alone. Returns true (o_scale filled, maxima
  // moved) when some row of the warp grew, or first saw a key; the decision is warp-uniform so the caller's
  // rescale is a branch the whole warp takes or skips. The threshold is 0: a stale max (kept while rows grow
  // by up to 2^8, as this once did; the same softmax, since the normalisation and LSE use the same maxima)
  // puts the row's largest probability, the term that dominates its output, at some c > 1 that takes the
  // rounding of P, where against the true max it is exactly 1 (2^kExpShift with fp8). That raised the
  // output's error against fp64 above cuDNN's and FlashAttention-4's, and the backward inherits it through
  // D = rowsum(dO o O) (docs/design.md, "Lazy O rescale").
  static constexpr float kLazyRescaleLog2 = 0.f;
  static_assert(kExpShift == 0 || kExpShift + kLazyRescaleLog2 <= 8.8f, "P would leave e4m3's range");
  template <class TensorS, class Off = NoRowOffset>
  __device__ __forceinline__ bool update_lazy(TensorS& s, cute::array<float, kRows>& o_scale, Off const& off = {}) {
    static_assert(decltype(cute::size<0>(s))::value == kRows);
    cute::array<float, kRows> m_new;
    bool grow = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m_new[r] = tile_row_max(s, r, off);
      // -inf -> finite is +inf > threshold; -inf -> -inf is NaN, not > threshold (nothing to rescale).
      grow |= (m_new[r] - row_max[r]) * scale_log2 > kLazyRescaleLog2;
    }
    const bool rescale = __any_sync(0xffffffffu, grow);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (rescale) o_scale[r] = move_max(r, m_new[r], max_offset(m_new[r]));
      exponentiate_row(s, r, max_offset(row_max[r]), off);
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
      lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + logf(sum) - float(kExpShift * M_LN2);
    }
    return inv;
  }
};

// Attention sinks on a finished tile: each row's softmax denominator gains exp(sink), a logit with no value
// behind it. With the row's normalized output o and natural-log lse: o *= sigmoid(lse - sink) and
// lse = logaddexp(lse, sink); a row that saw no key (lse = -inf) keeps o = 0 and gets lse = sink. The same
// merge flash_attn4._sinks applies after the fact, here in fp32 before the output is rounded.
template <class TensorO, class Lse>
__device__ __forceinline__ void apply_sink(TensorO& o, Lse& lse, float sink) {
#pragma unroll
  for (int r = 0; r < int(cute::size<0>(o)); ++r) {
    float w = 0.f, merged = sink;
    if (lse[r] != -INFINITY) {
      const float d = sink - lse[r];  // w = 1 / (1 + e^d), merged = max + log1p(e^-|d|)
      const float e = __expf(-fabsf(d));
      w = d > 0.f ? e / (1.f + e) : 1.f / (1.f + e);
      merged = fmaxf(sink, lse[r]) + log1pf(e);
    }
#pragma unroll
    for (int c = 0; c < cute::size<1>(o); ++c) o(r, c) *= w;
    lse[r] = merged;
  }
}

}  // namespace flash4
