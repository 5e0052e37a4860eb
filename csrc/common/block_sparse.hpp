// Block iterators of the forward: which key blocks a query tile visits, and in what order.
//
//   DenseBand   the band [n_block_min, n_block_max) that the causal / window mask leaves (block_info.hpp),
//               walked from the top down, so the blocks that need the mask come first.
//   SparseList  a block mask's two index lists per (batch, head, query block) (flash_attn4/block_mask.py):
//               "partial" blocks, computed with the call's element mask (causal / window), and "full"
//               blocks, computed without it. Mask blocks are kMaskBlock keys; a kernel block of kBlockN keys
//               is 1/kSub of one.
//
// The mainloop walks *virtual* block indices v = count - 1 ... 0 and asks the walk for the kernel block
// each stands for; for the dense band v is the block itself. The sparse walk puts the partial blocks on top
// (v >= n_full * kSub), so they too come first, and the mask-free steady state follows.
#pragma once

#include <cute/config.hpp>
#include <cute/numeric/math.hpp>

#include <cstdint>
#include <type_traits>

#include "../params.h"

namespace flash4 {

template <class Iter>
inline constexpr bool kIsSparse = std::is_same_v<Iter, SparseList>;

struct DenseWalk {
  CUTE_HOST_DEVICE int block(int v) const { return v; }
};

// One query tile's lists. Values that lie (counts past nk or negative, indices outside [0, nk)) are clamped,
// so a bad mask computes some in-bounds attention and never reads outside the lists or the K / V tensors.
template <int kBlockN>
struct SparseWalk {
  static_assert(kMaskBlock % kBlockN == 0, "a mask block must hold whole kernel blocks");
  static constexpr int kSub = kMaskBlock / kBlockN;
  const int* partial;
  const int* full;
  int n_partial, n_full, n_mask_blocks;

  CUTE_DEVICE SparseWalk(BlockSparseParams const& p, int bidb, int bidh, int m_block, int seqlen_k) {
    const int64_t c = bidb * p.count_batch_stride + bidh * p.count_head_stride + m_block * p.count_row_stride;
    const int64_t i = bidb * p.index_batch_stride + bidh * p.index_head_stride + m_block * p.index_row_stride;
    // The sequence's own key blocks bound the indices (never more than the lists hold).
    n_mask_blocks = cute::min(p.num_k_blocks, (seqlen_k + kMaskBlock - 1) / kMaskBlock);
    auto clamp_count = [&](int x) { return cute::min(cute::max(x, 0), p.num_k_blocks); };
    n_partial = n_mask_blocks > 0 ? clamp_count(p.kv_count[c]) : 0;
    n_full = n_mask_blocks > 0 ? clamp_count(p.full_count[c]) : 0;
    partial = p.kv_index + i;
    full = p.full_index + i;
  }
  // Virtual blocks: [0, count()).
  CUTE_DEVICE int count() const { return (n_partial + n_full) * kSub; }
  CUTE_DEVICE bool is_partial(int v) const { return v / kSub >= n_full; }
  CUTE_DEVICE int block(int v) const {
    const int slot = v / kSub;
    const int mb = slot >= n_full ? partial[slot - n_full] : full[slot];
    return cute::min(cute::max(mb, 0), n_mask_blocks - 1) * kSub + v % kSub;
  }
};

}  // namespace flash4
