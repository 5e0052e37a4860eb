// A two-entry ring in shared memory through which a persistent kernel's producer thread hands each tile to the
// consumer warps. The producer works the tile out anyway, a few steps before the consumers need it; worked out by
// the consumers themselves it sat between one tile's epilogue or store and the next tile's first GEMM (~1.1k
// cycles a tile in the forward and ~1.3k in the backward, tools/trace_tiles.py).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace flash4 {

// Payload: the tile as the consumers need it; its first member `linear` is the launch index, -1 past the last tile.
template <class Payload, int kConsumerWarps>
struct TileRing {
  alignas(16) cutlass::arch::ClusterBarrier full[2];
  alignas(16) cutlass::arch::ClusterBarrier empty[2];  // one arrival per consumer warp
  Payload tiles[2];

  CUTE_DEVICE void init() {
    for (int i = 0; i < 2; ++i) {
      full[i].init(/*arrive_count=*/1);
      empty[i].init(/*arrive_count=*/kConsumerWarps);
    }
  }

  // Producer, round r: the slot once every consumer warp has taken round r - 2 from it. Fill it, then commit(r).
  CUTE_DEVICE Payload& slot(int r) {
    if (r >= 2) empty[r & 1].wait(((r >> 1) - 1) & 1);
    return tiles[r & 1];
  }
  CUTE_DEVICE void commit(int r) { full[r & 1].arrive(); }

  // Consumer warps, round r (every lane; lane 0 frees the slot once the warp has read it).
  CUTE_DEVICE Payload take(int r, int thread_idx) {
    full[r & 1].wait((r >> 1) & 1);
    const Payload tile = tiles[r & 1];
    __syncwarp();
    if (thread_idx % 32 == 0) empty[r & 1].arrive();
    return tile;
  }
};

}  // namespace flash4
