// Score biases, one of DESIGN.md's score-modifier policies: the mainloops take one as a template parameter and
// add it to every score tile before the mask and the exponential. NoBias compiles to nothing; Alibi adds
// FlashAttention's ALiBi bias. A bias is a constant in the scores' derivative, so the backward's dS is
// unchanged: only the recomputation of P sees it.
#pragma once

#include <cute/tensor.hpp>

namespace flash4 {

// The mainloops test kEnabled before touching a bias (and kDrops before dropping probabilities: Dropout,
// common/dropout.hpp, shares this slot), so NoBias needs nothing else.
struct NoBias {
  static constexpr bool kEnabled = false;
  static constexpr bool kDrops = false;
};

// The logit of query i and key j gains -slope * |i + seqlen_k - seqlen_q - j| (bottom-right aligned, as the
// causal mask), computed per tile from the coordinates rather than loaded.
struct Alibi {
  static constexpr bool kEnabled = true;
  static constexpr bool kDrops = false;
  float slope;  // in the kernel's score units: the logit slope / (softmax scale)
  int offset;   // seqlen_k - seqlen_q of the tile's sequence

  // slopes[bidb * batch_stride + bidh] (bidb: the sequence, also in packed batches) in score units.
  CUTE_DEVICE static Alibi make(const float* slopes, int64_t batch_stride, int bidb, int bidh, int offset,
                                float units) {
    return {slopes[bidb * batch_stride + bidh] * units, offset};
  }

  // s(r, c) -= slope * |query - key| on a rowcol view of an accumulator tile with origin (row0, col0):
  // rows are queries and columns keys (forward), or the transpose (backward, S^T). tC gives this thread's
  // (row, col) coordinates, tC0 thread 0's: a thread's coordinates are its first one plus offsets that are the
  // same in every thread, so with thread 0's they fold to immediates and each element costs an add and an FMA.
  template <bool kRowsAreQueries, class TS, class TC, class TC0>
  CUTE_DEVICE void apply(TS& s, TC const& tC, TC0 const& tC0, int row0, int col0) const {
    using cute::get;
    const int row_thr = row0 + get<0>(tC(0, 0)) - get<0>(tC0(0, 0));
    const int col_thr = col0 + get<1>(tC(0, 0)) - get<1>(tC0(0, 0));
    // distance = query + offset - key = sign * (row - col) + offset
    const float base = float(kRowsAreQueries ? row_thr - col_thr + offset : col_thr - row_thr + offset);
#pragma unroll
    for (int r = 0; r < cute::size<0>(s); ++r) {
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) {
        const int step = get<0>(tC0(r, c)) - get<1>(tC0(r, c));
        const float d = base + float(kRowsAreQueries ? step : -step);
        s(r, c) = fmaf(-slope, fabsf(d), s(r, c));
      }
    }
  }

  // The forward's tiles that lie on one side of the diagonal (every key j <= i' = query + offset: side = +1,
  // or every j >= i': side = -1; a causal tile's keys past the diagonal are masked, so it counts as +1):
  // there -slope |i' - j| = side * slope * (j - i') splits into side * slope * (column offset), one FFMA with
  // an immediate an element, and a per-row part returned in `off` (OnlineSoftmax adds it to the row's max).
  template <class TS, class TC, class TC0, class Off>
  CUTE_DEVICE void apply_split(TS& s, TC const& tC, TC0 const& tC0, int row0, int col0, float side,
                               Off& off) const {
    using cute::get;
    const float k = side * slope;
    const float col_thr = float(col0 + get<1>(tC(0, 0)));
#pragma unroll
    for (int r = 0; r < cute::size<0>(s); ++r) {
      off[r] = k * (col_thr - float(row0 + offset + get<0>(tC(r, 0))));
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) {
        s(r, c) = fmaf(k, float(get<1>(tC0(0, c)) - get<1>(tC0(0, 0))), s(r, c));
      }
    }
  }
};

}  // namespace flash4
