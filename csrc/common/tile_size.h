// Tile sizes per (arch, head dim, causal), as small constexpr functions.
//
// sm90 forward: kBlockM = 128 rows of queries split over two consumer warpgroups (64 rows each: one
// WGMMA M-atom), kBlockN keys per K/V stage. The constraints that pick kBlockN:
//   * shared memory: Q (and O, which aliases it) + kStages * (K + V) <= 227 KB;
//   * registers: each consumer thread holds S (64 x kBlockN / 128 fp32), P (half that) and O
//     (64 x head_dim / 128 fp32) within the 240 registers setmaxnreg gives it.
// hdim 256 at kBlockN = 80: Q 64 KB + 2 x (40 + 40) KB = 224 KB, O 128 regs + S 40 regs.
#pragma once

namespace flash4 {

struct FwdTileSm90 {
  int block_m;
  int block_n;
  int stages;
};

constexpr FwdTileSm90 fwd_tile_sm90(int head_dim, bool /*causal*/) {
  return head_dim <= 64    ? FwdTileSm90{128, 128, 2}
         : head_dim <= 96  ? FwdTileSm90{128, 128, 2}
         : head_dim <= 128 ? FwdTileSm90{128, 128, 2}
         : head_dim <= 192 ? FwdTileSm90{128, 112, 2}
                           : FwdTileSm90{128, 80, 2};
}

}  // namespace flash4
