// Masks on a score tile held in registers (arch-independent: rowcol views of the scores and of the
// matching (row, col) coordinates inside the tile).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace flash4 {

// Sets to -inf every score whose key is past seqlen_k or, when kCausal, right of the bottom-right
// aligned diagonal (query i sees key j iff j <= i + seqlen_k - seqlen_q).
// row0/col0: global index of the tile's first query row / key column.
template <bool kCausal, class TensorS, class TensorC>
__device__ __forceinline__ void apply_mask(TensorS& s, TensorC const& coord, int row0, int col0, int seqlen_q,
                                           int seqlen_k) {
#pragma unroll
  for (int r = 0; r < cute::size<0>(s); ++r) {
    int col_limit = seqlen_k - col0;  // first masked column, tile-relative
    if constexpr (kCausal) {
      const int row = row0 + cute::get<0>(coord(r, 0));
      col_limit = min(col_limit, row + 1 + seqlen_k - seqlen_q - col0);
    }
#pragma unroll
    for (int c = 0; c < cute::size<1>(s); ++c) {
      if (cute::get<1>(coord(r, c)) >= col_limit) s(r, c) = -INFINITY;
    }
  }
}

}  // namespace flash4
