// Which blocks a tile must visit and which of them need a mask (arch-independent), and where each
// sequence of a batch lives (fixed-length or packed).
//
// Masks, all aligned to the bottom-right corner (off = seqlen_k - seqlen_q): query i sees key j iff
//   j < seqlen_k,  and with kCausal  j <= i + off,  and with kLocal  i + off - left <= j <= i + off + right.
// kLocal covers every sliding window (causal plus a left window is kLocal with right = 0); the host turns an
// unbounded side into a value larger than any length, so the kernels never branch on "unbounded".
#pragma once

#include <cute/config.hpp>
#include <cute/numeric/math.hpp>

namespace flash4 {

// Floor and ceiling of a / b for b > 0 and any sign of a (C++ division truncates toward zero).
CUTE_HOST_DEVICE constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
CUTE_HOST_DEVICE constexpr int ceil_div_signed(int a, int b) { return -floor_div(-a, b); }

// One sequence of the batch. Fixed-length batches: offsets 0, lengths from the shapes, batch = bidb.
// Packed (varlen) batches: sequence bidb owns rows [cu[bidb], cu[bidb + 1]) of the packed tensors, its
// length may be cut to seqused[bidb], and the global tensors have a batch extent of 1 (batch = 0).
// Offsets read on the device are clamped into the packed tensors (total rows): a negative offset reads
// as 0, one past the end as the end, a decreasing pair as an empty sequence, and seqused to [0, length],
// so offsets that lie compute some in-bounds attention and never address outside the tensors.
struct SeqInfo {
  int offset_q, offset_k;
  int seqlen_q, seqlen_k;
  int batch;
};

CUTE_DEVICE SeqInfo make_seq_info(const int* cu_seqlens_q, const int* cu_seqlens_k, const int* seqused_q,
                                  const int* seqused_k, int bidb, int seqlen_q, int seqlen_k, int total_q,
                                  int total_k) {
  SeqInfo s{0, 0, seqlen_q, seqlen_k, bidb};
  if (cu_seqlens_q != nullptr) {
    auto clamp = [](int x, int lo, int hi) { return cute::min(cute::max(x, lo), hi); };
    s.offset_q = clamp(cu_seqlens_q[bidb], 0, total_q);
    s.seqlen_q = clamp(cu_seqlens_q[bidb + 1], s.offset_q, total_q) - s.offset_q;
    s.offset_k = clamp(cu_seqlens_k[bidb], 0, total_k);
    s.seqlen_k = clamp(cu_seqlens_k[bidb + 1], s.offset_k, total_k) - s.offset_k;
    s.batch = 0;
  }
  if (seqused_q != nullptr) s.seqlen_q = cute::min(cute::max(seqused_q[bidb], 0), s.seqlen_q);
  if (seqused_k != nullptr) s.seqlen_k = cute::min(cute::max(seqused_k[bidb], 0), s.seqlen_k);
  return s;
}

// Block geometry of one sequence for tiles of kBlockM queries x kBlockN keys.
template <int kBlockM, int kBlockN, bool kCausal, bool kLocal>
struct BlockMask {
  static_assert(!(kCausal && kLocal), "a causal sliding window is kLocal with right = 0");
  static constexpr bool kHasRight = kCausal || kLocal;
  static constexpr bool kLocalMask = kLocal;
  static constexpr int kTileN = kBlockN;
  int seqlen_q, seqlen_k;
  int left, right;  // used with kLocal (right is 0 with kCausal)

  CUTE_HOST_DEVICE BlockMask(int seqlen_q_, int seqlen_k_, int left_, int right_)
      : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), left(left_), right(kCausal ? 0 : right_) {}

  CUTE_HOST_DEVICE int off() const { return seqlen_k - seqlen_q; }

  // Forward: query tile m visits key blocks [n_block_min, n_block_max); empty (max <= min) when no row of
  // the tile sees any key, and then the tile writes out = 0, lse = -inf without loading anything. The
  // tile's last row may lie past seqlen_q (padding): that only widens the range.
  CUTE_HOST_DEVICE int n_block_max(int m_block) const {
    int n_max = (seqlen_k + kBlockN - 1) / kBlockN;
    if constexpr (kHasRight) {
      const int last_col_plus_1 = (m_block + 1) * kBlockM + off() + right;
      n_max = last_col_plus_1 <= 0 ? 0 : cute::min(n_max, (last_col_plus_1 + kBlockN - 1) / kBlockN);
    }
    return n_max;
  }
  CUTE_HOST_DEVICE int n_block_min(int m_block) const {
    if constexpr (kLocal) return cute::max(0, floor_div(m_block * kBlockM + off() - left, kBlockN));
    return 0;
  }
  // Blocks >= this one may hold keys right of some row's right bound (the diagonal, when causal): masked.
  CUTE_HOST_DEVICE int n_block_right_mask_min(int m_block) const {
    return floor_div(m_block * kBlockM + off() + right, kBlockN);
  }
  // Blocks < this one may hold keys left of some row's left bound: masked (kLocal only).
  CUTE_HOST_DEVICE int n_block_left_mask_max(int m_block) const {
    if constexpr (kLocal) return cute::max(0, ceil_div_signed((m_block + 1) * kBlockM - 1 + off() - left, kBlockN));
    return 0;
  }

  // Backward: key block n is seen by query blocks [m_block_min, m_block_max) (empty when max <= min).
  CUTE_HOST_DEVICE int m_block_min(int n_block) const {
    if constexpr (kHasRight) return cute::max(0, floor_div(n_block * kBlockN - off() - right, kBlockM));
    return 0;
  }
  CUTE_HOST_DEVICE int m_block_max(int n_block) const {
    int m_max = (seqlen_q + kBlockM - 1) / kBlockM;
    if constexpr (kLocal) {
      m_max = cute::min(m_max, floor_div((n_block + 1) * kBlockN - 1 - off() + left, kBlockM) + 1);
    }
    return m_max;
  }
  // Backward: whether tile (m, n) holds any masked (query, key) pair, the sequence's key end included.
  CUTE_HOST_DEVICE bool tile_needs_mask(int m_block, int n_block) const {
    const int key0 = n_block * kBlockN, query0 = m_block * kBlockM;
    bool need = key0 + kBlockN > seqlen_k;
    if constexpr (kHasRight) need |= key0 + kBlockN - 1 > query0 + off() + right;
    if constexpr (kLocal) need |= key0 < query0 + kBlockM - 1 + off() - left;
    return need;
  }
  // Whether query `row` sees key `col` (both within the sequence's index space).
  CUTE_HOST_DEVICE bool masked(int row, int col) const {
    bool m = col >= seqlen_k;
    if constexpr (kHasRight) m |= col > row + off() + right;
    if constexpr (kLocal) m |= col < row + off() - left;
    return m;
  }
};

}  // namespace flash4
