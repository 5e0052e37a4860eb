// Tile sizes per (arch, head dim, causal), as small constexpr functions.
//
// sm90 forward: kBlockM = 128 rows of queries split over two consumer warpgroups (64 rows each: one
// WGMMA M-atom), kBlockN keys per K/V stage. The constraints that pick kBlockN:
//   * shared memory: Q (and O, which aliases it) + kStages * (K + V) <= 227 KB;
//   * registers: each consumer thread holds S (64 x kBlockN / 128 fp32), P (half that) and O
//     (64 x head_dim / 128 fp32) within the 240 registers setmaxnreg gives it.
// hdim 128 non-causal at kBlockN = 176: Q 32 KB + 2 x (44 + 44) KB = 208 KB; S 88 + P 44 + O 64 regs.
//   Causal keeps 128: more of its blocks are diagonal (masked) ones, and a smaller N wastes less there.
// hdim 256 at kBlockN = 64: kBlockN = 80 spilled 48 bytes in the main loop (O 128 + S 40 + P 20 regs
//   live at once under the two in-flight GEMMs); 64 does not spill.
#pragma once

namespace flash4 {

struct FwdTileSm90 {
  int block_m;
  int block_n;
  int stages;
};

constexpr FwdTileSm90 fwd_tile_sm90(int head_dim, bool causal) {
  return head_dim <= 64    ? FwdTileSm90{128, 128, 2}
         : head_dim <= 96  ? FwdTileSm90{128, 128, 2}
         : head_dim <= 128 ? FwdTileSm90{128, causal ? 128 : 176, 2}
         : head_dim <= 192 ? FwdTileSm90{128, 112, 2}
                           : FwdTileSm90{128, 64, 2};
}

}  // namespace flash4
