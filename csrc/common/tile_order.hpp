// Launch order of a masked (causal / windowed) grid of (block, head, batch) tiles, for every architecture.
//
// Causal tiles differ in cost: a query tile sees up to all key blocks, a key tile is seen by up to all query
// blocks. The hardware hands out CTAs in launch-index order (x fastest), so that order decides the tail.
// With the block index fastest, the heavy tiles of the last heads start late and run alone at the end: a
// list-scheduling simulation over 132 SMs puts batch 2 x 16 heads x 4096 tokens (32 blocks a head) at 13%
// over the ideal makespan, 4096 x 4 batches at 7%, 2048 x 8 at 7%. Heaviest-first over the whole grid removes
// the tail but spreads the CTAs running at once over every head, each streaming its own K/V (forward) or
// Q/dO (backward) past the L2. So heads go in groups of about kGroupTiles / num_blocks (the group's K and V,
// 4 * kGroupTiles * 128 * head_dim bytes = 32 MB, fit in the 50-60 MB L2 of an H100/H200), and inside a group
// the block index is the slow one: the heaviest tile of every head of the group first, then the next. The
// same simulation: every shape above within 1.1% of the ideal; long sequences (16k, 32k), already within
// 1%, stay there. Groups are balanced (sizes differ by at most one) so that no small group ends the grid.
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

// Tile of launch index `linear` in a grid of num_blocks x num_heads x num_batch tiles.
template <int kHeadDim>
FLASH4_HOST_DEVICE TileCoord grouped_tile_order(int linear, int num_blocks, int num_heads, int num_batch) {
  constexpr int kGroupTiles = 512 * 128 / kHeadDim;
  const int hb_total = num_heads * num_batch;
  int target = kGroupTiles / num_blocks;
  target = target < 1 ? 1 : (target > hb_total ? hb_total : target);
  const int num_groups = (hb_total + target - 1) / target;
  // Group g owns head-batch indices [start(g), start(g + 1)), start(g) = floor(g * hb_total / num_groups).
  auto start = [&](int g) { return int(int64_t(g) * hb_total / num_groups); };
  int g = int(int64_t(linear) * num_groups / (int64_t(num_blocks) * hb_total));
  while (g + 1 < num_groups && int64_t(start(g + 1)) * num_blocks <= linear) ++g;
  while (g > 0 && int64_t(start(g)) * num_blocks > linear) --g;
  const int first = start(g), size = start(g + 1) - first;
  const int offset = linear - first * num_blocks;
  const int hb = first + offset % size;
  return {offset / size, hb % num_heads, hb / num_heads};
}

#if defined(__CUDACC__)
// The tile of this CTA: for masked launches the grouped order above, otherwise the grid's own coordinates.
template <int kHeadDim, bool kReorder>
__device__ __forceinline__ TileCoord this_tile() {
  if constexpr (kReorder) {
    const int linear = int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    return grouped_tile_order<kHeadDim>(linear, int(gridDim.x), int(gridDim.y), int(gridDim.z));
  } else {
    return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  }
}
#endif

}  // namespace flash4
