// Launch order of a masked (causal / windowed) grid of (block, head, batch) tiles, for every architecture.
//
// Causal tiles differ in cost: a query tile sees up to all key blocks, a key tile is seen by up to all query
// blocks. The hardware hands out CTAs in launch-index order (x fastest), so that order decides the tail.
// With the block index fastest, the heavy tiles of the last heads start late and run alone at the end: a
// list-scheduling simulation over 132 SMs puts batch 2 x 16 heads x 4096 tokens (32 blocks a head) at 13%
// over the ideal makespan, 4096 x 4 batches at 7%, 2048 x 8 at 7%. Heaviest-first over the whole grid removes
// the tail but spreads the CTAs running at once over every head, each streaming its own K/V (forward) or
// Q/dO (backward) past the L2. So heads go in groups of about group_tiles / num_blocks (forward: the group's K
// and V, 4 * group_tiles * 128 * head_dim bytes = 32 MB; the backward's groups in make_bwd), and inside a group
// the block index is the slow one: the heaviest tile of every head of the group first, then the next. The
// same simulation: every shape above within 1.1% of the ideal; long sequences (16k, 32k), already within
// 1%, stay there. Groups are balanced (sizes differ by at most one, the larger ones first) so that no small
// group ends the grid.
//
// Sliding windows: nearly every tile costs the same (the window), except the last tail_blocks of each head in
// launch order (a head's first queries in the forward, its last keys in the backward), which see fewer keys.
// Left inside the groups, each group's short tiles are followed by the next group's full ones and only the
// last group's fill the end: the simulation puts window 4096 at 32k x 16 heads 0.9-1.1% over the ideal
// makespan. With every head's tail_blocks moved behind all full tiles (heaviest first, heads fastest),
// 0.2-0.5%. The full tiles keep the grouped order; each head still gets its blocks in launch order.
//
// The order's constants depend only on the grid, so the sm90 launchers compute them on the host (TileOrder::make)
// and a CTA finds its tile with three 32-bit divisions. Computed in every CTA (64-bit divisions and a search)
// they cost ~2k cycles at the start of each CTA, ahead of its first load: 2.5% of a 4096-window forward at 32k
// (tools/trace_tiles.py; docs/design.md, "Launch order and persistent kernels").
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASH4_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASH4_HOST_DEVICE inline
#endif

namespace flash4 {

struct TileCoord {
  int block;  // 0 = the first launched of its head: the caller maps it to its heaviest block
  int head;
  int batch;
};

// The launch order of a grid of num_blocks x num_heads x num_batch tiles (the grid's own x, y, z).
struct TileOrder {
  int num_heads;
  int head_blocks;  // block indices [0, head_blocks) go in groups, the rest (the tail) after them
  int hb_total;     // head-batches
  int big;          // head-batches of the first num_big groups; the others have big - 1
  int num_big;

  // tail_blocks: 0 <= tail_blocks <= num_blocks (see the top of this file). group_tiles: the tiles of a group
  // (make_bwd says why the backward takes fewer).
  template <int kHeadDim>
  FLASH4_HOST_DEVICE static TileOrder make(int num_blocks, int num_heads, int num_batch, int tail_blocks = 0,
                                           int group_tiles = 512 * 128 / kHeadDim) {
    TileOrder o{};
    o.num_heads = num_heads;
    o.head_blocks = num_blocks - tail_blocks;
    o.hb_total = num_heads * num_batch;
    int target = o.head_blocks > 0 ? group_tiles / o.head_blocks : 1;
    target = target < 1 ? 1 : (target > o.hb_total ? o.hb_total : target);
    const int num_groups = (o.hb_total + target - 1) / target;
    const int small = o.hb_total / num_groups;
    o.num_big = o.hb_total - small * num_groups;
    o.big = small + 1;
    return o;
  }

  // The backward's key tiles stream the Q and dO (16-bit) and dq_accum (fp32) rows of every query head of their
  // kv head, 8 * head_dim bytes a row and query head, twice the forward's K and V per row; and dq_accum is
  // read-modified-written in the L2. A group takes 16 MB of those: a quarter of the forward's tiles. At 1k
  // tokens, head dim 64, that is 32 heads a group instead of 128, whose 132 CTAs in flight otherwise each stream
  // their own head's Q / dO, reread by the head's other key tiles after the L2 has moved on (tools/l2_model.py:
  // HBM reads 2-4x the compulsory bytes -> 1x). Measured at head dims 64 and 128 without GQA; everything else
  // keeps the forward's groups. There the same model has smaller groups' tails cost 2-5% of the makespan at
  // head dim 96 and 9-11% at 256 from 2k tokens, and GQA's 16 MB (over the ratio) a group of one kv head-batch
  // at 8k: 64 tiles for 132 SMs, +11% at a ratio of 4.
  template <int kHeadDim>
  FLASH4_HOST_DEVICE static TileOrder make_bwd(int num_blocks, int nheads_kv, int num_batch, int tail_blocks,
                                               int gqa_ratio) {
    if constexpr (kHeadDim == 64 || kHeadDim == 128) {
      constexpr int kTiles = 512 * 128 / kHeadDim / 4;
      if (gqa_ratio == 1) return make<kHeadDim>(num_blocks, nheads_kv, num_batch, tail_blocks, kTiles);
    }
    return make<kHeadDim>(num_blocks, nheads_kv, num_batch, tail_blocks);
  }

  // Tile of launch index `linear`.
  FLASH4_HOST_DEVICE TileCoord operator()(int linear) const {
    const int grouped = head_blocks * hb_total;
    if (linear >= grouped) {  // the tail: block index slow, every head-batch at each
      const int r = linear - grouped;
      const int hb = r % hb_total;
      return {head_blocks + r / hb_total, hb % num_heads, hb / num_heads};
    }
    const int big_tiles = num_big * big * head_blocks;
    int first, size, offset;
    if (linear < big_tiles) {
      const int g = linear / (big * head_blocks);
      first = g * big, size = big, offset = linear - g * big * head_blocks;
    } else {
      const int small = big - 1, r = linear - big_tiles;
      const int g = r / (small * head_blocks);
      first = num_big * big + g * small, size = small, offset = r - g * small * head_blocks;
    }
    // Inside a group the block index is the slow one.
    const int hb = first + offset % size;
    return {offset / size, hb % num_heads, hb / num_heads};
  }
};

// Persistent kernels (the sm90 window forward and backward): one CTA per SM (num_sms; 132, an H100 / H200, when
// unknown), fewer when there are fewer tiles.
FLASH4_HOST_DEVICE int persistent_ctas(int num_tiles, int num_sms) {
  const int sms = num_sms > 0 ? num_sms : 132;
  return num_tiles < sms ? num_tiles : sms;
}

#if defined(__CUDACC__)
// Persistent kernels: the launch index of this CTA's tile in round r, or -1 past the last tile. A static snake
// order: round r gives tile r * G + k (r even) or r * G + G - 1 - k (r odd) to CTA k of G. A list-scheduling
// simulation of window 4096 at 32k x 16 heads with the short tiles last: 0.1-0.4% over the ideal makespan, as the
// hardware's dynamic order; plain round robin 1.7-1.8%.
__device__ __forceinline__ int snake_tile(int r, int num_tiles) {
  const int g = int(gridDim.x), k = int(blockIdx.x);
  const int linear = r * g + ((r & 1) ? g - 1 - k : k);
  return linear < num_tiles ? linear : -1;
}

__device__ __forceinline__ int linear_cta() {
  return int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}

// The tile of launch index `linear` of this grid: for masked launches `order` (made for this grid),
// otherwise the grid's own coordinates.
template <bool kReorder>
__device__ __forceinline__ TileCoord tile_at(TileOrder const& order, int linear) {
  if constexpr (kReorder) {
    return order(linear);
  } else {
    const int blocks = int(gridDim.x), heads = int(gridDim.y);
    return {linear % blocks, (linear / blocks) % heads, linear / (blocks * heads)};
  }
}

// The tile of this CTA, with an order made on the host (the sm90 kernels).
template <bool kReorder>
__device__ __forceinline__ TileCoord this_tile(TileOrder const& order) {
  if constexpr (kReorder) {
    return order(linear_cta());
  } else {
    return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  }
}

// The same, making the order in the CTA (the sm80 kernels, which take the torch-free params as they are).
template <int kHeadDim, bool kReorder>
__device__ __forceinline__ TileCoord this_tile() {
  if constexpr (kReorder) {
    return TileOrder::make<kHeadDim>(int(gridDim.x), int(gridDim.y), int(gridDim.z))(linear_cta());
  } else {
    return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  }
}
#endif

}  // namespace flash4
