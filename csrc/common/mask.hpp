// Masks and score transforms on a score tile held in registers (arch-independent: rowcol views of the
// scores and of the matching (row, col) coordinates inside the tile).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "block_info.hpp"
#include "fast_math.hpp"

namespace flash4 {

// Sets to -inf every score that `bm` masks (key past seqlen_k, right of the causal diagonal / right window
// bound, left of the left window bound). row0/col0: the tile's first query row / key column in the sequence.
template <class BM, class TensorS, class TensorC>
__device__ __forceinline__ void apply_mask(TensorS& s, TensorC const& coord, int row0, int col0, BM const& bm) {
#pragma unroll
  for (int r = 0; r < cute::size<0>(s); ++r) {
    const int row = row0 + cute::get<0>(coord(r, 0));
    // Visible columns of this row, tile-relative: [col_lo, col_hi).
    int col_hi = bm.seqlen_k - col0;
    int col_lo = 0;
    if constexpr (BM::kHasRight) col_hi = min(col_hi, row + 1 + bm.off() + bm.right - col0);
    if constexpr (BM::kLocalMask) col_lo = row + bm.off() - bm.left - col0;
#pragma unroll
    for (int c = 0; c < cute::size<1>(s); ++c) {
      const int col = cute::get<1>(coord(r, c));
      if (col >= col_hi || (BM::kLocalMask && col < col_lo)) s(r, c) = -INFINITY;
    }
  }
}

// Softcap: s <- tanh(s * scale / cap) in place. The kernels then treat the result as a score whose softmax
// scale is `cap` (cap * tanh(...) is the capped scaled score), so the online softmax is unchanged.
template <class TensorS>
__device__ __forceinline__ void apply_softcap(TensorS& s, float scale_over_cap) {
#pragma unroll
  for (int i = 0; i < cute::size(s); ++i) s(i) = tanh_approx(s(i) * scale_over_cap);
}

}  // namespace flash4
