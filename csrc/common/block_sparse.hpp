// Block iterators: which blocks a tile visits, and in what order.
//
//   DenseBand   the band the causal / window mask leaves (block_info.hpp): key blocks [n_block_min,
//               n_block_max) of a query tile (forward), query blocks [m_block_min, m_block_max) of a key tile
//               (backward).
//   SparseList  a block mask's two index lists per (batch, head, row block) (flash_attn4/block_mask.py):
//               "partial" blocks, computed with the call's element mask (causal / window), and "full"
//               blocks, computed without it. The forward reads the lists of query blocks (key blocks each
//               reads), the backward their transpose (query blocks that read each key block). Mask blocks
//               are kMaskBlock tokens; a kernel block is 1/kSub of one.
//
// The loops walk *virtual* block indices v in [0, count) and ask the walk for the kernel block each stands
// for; for the dense band v is the block itself (forward) or its offset from m_block_min (backward). The
// forward walks v from the top down; the sparse walk puts the partial blocks on top (v >= n_full * kSub),
// so they too come first, and the mask-free steady state follows.
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
  CUTE_HOST_DEVICE int block(BlockSparseParams const&, int v) const { return v; }
  CUTE_HOST_DEVICE bool is_partial(int) const { return true; }
};

// One row of the lists: mask row `row` (a query block forward, a key block backward) of (batch, head);
// its entries index blocks of a sequence `length` tokens long, kSub kernel blocks each. Values that lie
// (counts past the lists' length or negative, indices outside [0, blocks)) are clamped, so a bad mask
// computes some in-bounds attention and never reads outside the lists or the tensors. Four registers: the
// lists' base pointers stay in the kernel parameters (block() takes them), and the row's offset is 32-bit
// (the binding keeps the lists under 2^31 elements); the backward's steps have no register to spare.
template <int kBlock>
struct SparseWalk {
  static_assert(kMaskBlock % kBlock == 0, "a mask block must hold whole kernel blocks");
  static constexpr int kSub = kMaskBlock / kBlock;
  int offset;  // of the row in the index lists
  int n_full;  // slots [0, n_full) are full blocks, [n_full, n_slots) partial ones
  int n_slots;
  int last;  // the sequence's last mask block

  SparseWalk() = default;
  CUTE_DEVICE SparseWalk(BlockSparseParams const& p, int bidb, int bidh, int row, int length) {
    const int64_t c = bidb * p.count_batch_stride + bidh * p.count_head_stride + row * p.count_row_stride;
    offset = int(bidb * p.index_batch_stride + bidh * p.index_head_stride + row * p.index_row_stride);
    // The sequence's own blocks bound the indices (never more than the lists hold).
    last = cute::min(p.num_blocks, (length + kMaskBlock - 1) / kMaskBlock) - 1;
    auto clamp_count = [&](int x) { return cute::min(cute::max(x, 0), p.num_blocks); };
    n_full = last >= 0 ? clamp_count(p.full_count[c]) : 0;
    n_slots = last >= 0 ? n_full + clamp_count(p.kv_count[c]) : 0;
  }
  // Virtual blocks: [0, count()).
  CUTE_DEVICE int count() const { return n_slots * kSub; }
  CUTE_DEVICE bool is_partial(int v) const { return v / kSub >= n_full; }
  CUTE_DEVICE int block(BlockSparseParams const& p, int v) const {
    const int slot = v / kSub;
    const int mb = slot >= n_full ? p.kv_index[offset + slot - n_full] : p.full_index[offset + slot];
    return cute::min(cute::max(mb, 0), last) * kSub + v % kSub;
  }
};

// The backward's dense band of one key tile: query blocks [m_min, m_min + count).
struct DenseWalkBwd {
  int m_min, n;
  CUTE_DEVICE int count() const { return n; }
  CUTE_DEVICE bool is_partial(int) const { return true; }
  CUTE_DEVICE int block(BlockSparseParams const&, int v) const { return m_min + v; }
};

// The mask of one step (backward) of a sparse walk: a partial block takes the call's element mask, a full
// block only the sequence's key end (rows past the query end have lse_log2 = +inf and give P = 0 anyway).
// Mask is BlockMask (block_info.hpp); `partial` is uniform across the CTA. Bitwise, not branches: a branch
// per element made the masked pass a ladder of jumps.
template <class Mask>
struct StepMask {
  Mask const& bm;
  bool partial;
  CUTE_DEVICE bool tile_needs_mask(int m_block, int n_block) const {
    return (n_block + 1) * Mask::kTileN > bm.seqlen_k || (partial && bm.tile_needs_mask(m_block, n_block));
  }
  CUTE_DEVICE bool masked(int row, int col) const { return (col >= bm.seqlen_k) | (partial & bm.masked(row, col)); }
};

// The same, as a BlockMask (block_info.hpp) for the kernels that take one: a full block's mask is the call's
// with both window sides unbounded, which leaves only the key end (tile_needs_mask, masked and apply_mask
// then need no second code path).
template <class Mask>
CUTE_DEVICE Mask step_block_mask(Mask bm, bool partial) {
  if (!partial) bm.left = bm.right = bm.seqlen_q + bm.seqlen_k + 1;
  return bm;
}

}  // namespace flash4
