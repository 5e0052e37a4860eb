// Which key blocks a query tile must visit (arch-independent).
#pragma once

#include <cute/config.hpp>
#include <cute/numeric/math.hpp>

namespace flash4 {

// Number of key blocks of size kBlockN that query tile m_block (rows [m*M, m*M + M)) sees: blocks
// [0, n_block_max). Causal (bottom-right aligned) cuts the range at the tile's last row's diagonal.
// A result <= 0 means no row of the tile sees any key (causal with seqlen_q > seqlen_k): the tile
// writes out = 0, lse = -inf without loading anything.
template <int kBlockM, int kBlockN, bool kCausal>
CUTE_HOST_DEVICE int n_block_max(int m_block, int seqlen_q, int seqlen_k) {
  int n_max = (seqlen_k + kBlockN - 1) / kBlockN;
  if constexpr (kCausal) {
    const int last_col_plus_1 = (m_block + 1) * kBlockM + seqlen_k - seqlen_q;
    n_max = last_col_plus_1 <= 0 ? 0 : cute::min(n_max, (last_col_plus_1 + kBlockN - 1) / kBlockN);
  }
  return n_max;
}

// Key blocks at or above this index may hold keys right of some row's causal diagonal, so they are
// masked; blocks below it are fully visible to every row of the tile. (Division truncates toward zero,
// so a negative offset masks every block: safe.)
template <int kBlockM, int kBlockN>
CUTE_HOST_DEVICE int n_block_min_causal_mask(int m_block, int seqlen_q, int seqlen_k) {
  return (m_block * kBlockM + seqlen_k - seqlen_q) / kBlockN;
}

}  // namespace flash4
