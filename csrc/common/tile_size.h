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

// sm80 forward (cp.async + mma.sync): kBlockM query rows over kWarps warps (16 rows per warp per slab),
// kBlockN keys, one K and one V buffer. Registers per thread: O = kBlockM / (16 kWarps) * head_dim / 2 fp32,
// S = kBlockM / (16 kWarps) * kBlockN / 2, P half of S. With 4 warps, hdim 128 at kBlockN = 64 used 255
// registers and spilled 100 bytes (O 128 + S 64 + P 32); kBlockN = 32 halves S and P. 8 warps at hdim
// >= 192 give each warp one 16-row slab, so O is 128 registers at hdim 256. Shared memory (Q + K + V): hdim
// 128 at 128 x 32 is 48 KB, hdim 256 at 128 x 64 is 128 KB (one CTA on A100 and H100; too large for sm86/89's
// 99 KB, which will need its own row of this table). Not yet measured on a GPU.
struct FwdTileSm80 {
  int block_m;
  int block_n;
  int warps;
};

constexpr FwdTileSm80 fwd_tile_sm80(int head_dim) {
  return head_dim <= 64    ? FwdTileSm80{128, 64, 4}
         : head_dim <= 128 ? FwdTileSm80{128, 32, 4}
                           : FwdTileSm80{128, 64, 8};
}

}  // namespace flash4
