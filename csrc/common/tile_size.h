// Tile sizes per (direction, arch, head dim, causal), as small constexpr functions: one table for both
// directions and both kernel families, read by the launchers (launch/*.hpp), which instantiate the traits
// with these values. docs/design.md, "Tile sizes", has the reasoning at length.
//
// sm90 forward: kBlockM = 128 rows of queries split over two consumer warpgroups (64 rows each: one
// WGMMA M-atom; 192 over three at hdim 64, below), kBlockN keys per K/V stage. The constraints that pick
// kBlockN:
//   * shared memory: Q (and O, which aliases it) + kStages * (K + V) <= 227 KB;
//   * registers: each consumer thread holds S (64 x kBlockN / 128 fp32), P (half that) and O
//     (64 x head_dim / 128 fp32) within the 240 registers setmaxnreg gives it.
// hdim 128 non-causal at kBlockN = 176: Q 32 KB + 2 x (44 + 44) KB = 208 KB; S 88 + P 44 + O 64 regs.
//   Causal keeps 128: more of its blocks are diagonal (masked) ones, and a smaller N wastes less there.
// hdim 256: kBlockN = 80 (FA4's tile) where the scores are plain and unmasked (0 B spill); masked tiles keep
//   64 (80 spilled 80 B in the causal step: O 128 + S 40 + P 20 registers live under the two in-flight GEMMs,
//   and ran 1-3% slower; docs/experiments.md), and so do ALiBi / dropout.
#pragma once

namespace flash4 {

struct FwdTileSm90 {
  int block_m;
  int block_n;
  int stages;
};

// MLA heads (q / k 192, v 128; head_dim_v 0 means head_dim): V and O are hdim 128's, which leaves room for 128
// keys a stage: Q 48 KB (O aliases it) + 2 x (K 48 + V 32) KB = 208 KB; S 64 + P 32 + O 64 registers. 144 keys
// would need 228 KB.
// hdim 64 takes 192 query rows (three consumer warpgroups at 160 registers: S 64 + P 32 + O 32) where the
// scores are plain (dense, unmasked but for the key end, no bias or dropout): with two warpgroups each step's
// softmax is long beside its short GEMMs, and a third warpgroup's GEMMs fill the gap. The causal and window
// kernels spilled 116 / 220 B at 160 registers with 128 keys a block; they take 96 (S 48 registers).
constexpr FwdTileSm90 fwd_tile_sm90(int head_dim, bool causal, int head_dim_v = 0, bool plain = false) {
  return head_dim_v != 0 && head_dim_v < head_dim ? FwdTileSm90{128, 128, 2}
         : head_dim <= 64  ? (plain ? FwdTileSm90{192, causal ? 96 : 128, 2} : FwdTileSm90{128, 128, 2})
         : head_dim <= 96  ? FwdTileSm90{128, 128, 2}
         : head_dim <= 128 ? FwdTileSm90{128, causal ? 128 : 176, 2}
         : head_dim <= 192 ? FwdTileSm90{128, 112, 2}
                           : FwdTileSm90{128, plain && !causal ? 80 : 64, 2};
}

// sm90 fp8 forward (e4m3 q, k, v; bf16 out): 128 x 128 tiles. Registers per consumer thread: S 64, P 16 (one
// byte a value), O 64 and the two-level accumulation's block fragment 64 (MainloopFwdSm90). Shared memory:
// Q 16 KB + O 32 KB (bf16, its own buffer) + kStages x (K + V^T) 32 KB. Masked tiles at head dim 128 take
// kBlockN = 96: the masked step spilled 24 B at 128. Head dim 256: 128 x 64 (O 128 + S 32 + P 8 registers, P V
// straight into O), Q 32 KB + O 64 KB + 3 x (K + V^T) 32 KB.
constexpr FwdTileSm90 fwd_tile_sm90_fp8(int head_dim, bool masked) {
  return head_dim > 128 ? FwdTileSm90{128, 64, 3}
                        : FwdTileSm90{128, masked && head_dim > 64 ? 96 : 128, head_dim <= 64 ? 4 : 3};
}

// sm80 forward (cp.async + mma.sync): kBlockM query rows over kWarps warps (16 rows per warp per slab),
// kBlockN keys, two K and V buffers at hdim 64 / 128 (FwdTraitsSm80::kStages), one otherwise. Registers per
// thread: O = kBlockM / (16 kWarps) * head_dim / 2 fp32, S = kBlockM / (16 kWarps) * kBlockN / 2, P half of S.
// What chose each row (H200, forced sm80 path, against SDPA's FA2 backend in the same run):
//   hdim <= 64: 128 x 64, 4 warps. FA2's 128 x 128 spills 148-184 bytes (S 128 + O 64 registers) and
//     measured -33% non-causal; 128 x 64 runs 1.00-1.05x FA2 (seqlen 2k-8k, with two K / V buffers).
//   hdim <= 128: 128 x 32, 4 warps. 128 x 64 over 4 warps spills 64-128 bytes (O 128 + S 64 + P 32); over 8
//     warps it compiles without spills but measured 0.74x FA2 (every warp reads all of K and V); 128 x 32
//     runs 0.98-1.08x FA2 (seqlen 2k-8k, with two K / V buffers).
//   hdim > 128: 128 x 64, 8 warps (one 16-row slab a warp, O 128 registers at hdim 256); passes the GPU tests,
//     speed not compared yet.
// Shared memory (Q + kStages x (K + V)): hdim 128 at 128 x 32 is 64 KB, hdim 192 at 128 x 64 96 KB, hdim 256
// at 128 x 64 128 KB (A100 164 KB and H100 227 KB a CTA). `small_smem`: the row a card with 99 KB a CTA
// (sm86 / 89 / 120) gets; only hdim 256 differs: 64 x 64 over 4 warps (Q 32 + K / V 64 = 96 KB), the same
// 16-row slab and registers per warp, half the query rows per K / V load.
struct FwdTileSm80 {
  int block_m;
  int block_n;
  int warps;
};

// The shared memory a CTA may take on sm86 / 89 / 120 (cudaDevAttrMaxSharedMemoryPerBlockOptin, 99 KB).
constexpr int kSmemConsumer = 101376;

constexpr FwdTileSm80 fwd_tile_sm80(int head_dim, bool small_smem = false) {
  return head_dim <= 64    ? FwdTileSm80{128, 64, 4}
         : head_dim <= 128 ? FwdTileSm80{128, 32, 4}
         : head_dim > 192 && small_smem ? FwdTileSm80{64, 64, 4}
                                        : FwdTileSm80{128, 64, 8};
}

// sm90 backward: kBlockN keys per CTA (dK and dV live in registers for the CTA's life), kBlockM queries per
// step, kStages Q / dO stages (even: the dS buffer parity follows the stage index).
//   hdim <= 128: 128 keys, 64 per consumer warpgroup (one WGMMA M-atom), dK + dV 64 x head_dim fp32 each per
//     warpgroup (128 registers at hdim 128) beside S^T, dP^T and the dQ accumulator (BwdTraitsSm90).
//   hdim > 128 (wide): a 64 x head_dim dK plus dV per warpgroup would be 192 / 256 registers, so the two
//     warpgroups split dK and dV along head_dim and one CTA owns 64 keys (BwdWideTraitsSm90). Q / dO / K / V
//     / P / dS at hdim 256 take 226 of the 227 KiB of shared memory with two stages.
struct BwdTileSm90 {
  int block_m;
  int block_n;
  int stages;
  bool wide;  // warpgroups split dK / dV along head_dim instead of along keys
};

//   hdim 64: 128 queries a step (S^T and dP^T 64 registers each, dK + dV + dQ 96) halves the steps and their
//     barriers; its dK GEMM retires within the step so that dS^T is dead when the next S^T / dP^T issue (224
//     live registers otherwise: ptxas serialized the GEMMs). Dropout keeps 64 (120 B spill at 128).
constexpr BwdTileSm90 bwd_tile_sm90(int head_dim, bool drops = false) {
  return head_dim <= 64 && !drops ? BwdTileSm90{128, 128, 2, false}
         : head_dim <= 128        ? BwdTileSm90{64, 128, 2, false}
                                  : BwdTileSm90{64, 64, 2, true};
}

// sm80 backward (FlashAttention-2's algorithm, 8 warps, keys as the GEMM rows; BwdTraitsSm80), kStages Q / dO
// buffers:
//   hdim <= 128: 128 keys (16 a warp) x 64 queries a step. 128 queries at hdim 64 (FA2's tile) measured -2.5%
//     (255 registers with a spill, twice the work between barriers with all 8 warps in lockstep).
//   hdim > 128: the warps form two halves that split dK / dV's head-dim columns, so a CTA owns 64 keys; 32
//     queries a step keep shared memory at 132.5 KiB at hdim 256 (A100: 164 KB a CTA).
// Shared memory: K + V + kStages x (Q + dO) + dS^T: hdim 64 81 KB, 96 113 KB, 128 145 KB, 192 100.5 KB, 256
// 132.5 KB. `small_smem` (99 KB a CTA: sm86 / 89 / 120) keeps hdim 64 and otherwise:
//   hdim 96: one Q / dO buffer (88.5 KB): the next block loads behind the dQ GEMM instead of the whole step.
//     Two 64-key halves would need 48-column swizzle atoms.
//   hdim 128: 32 queries a step, one buffer (88.25 KB). 64 keys as two halves (the hdim > 128 scheme, both
//     buffers, 68.5 KB) measured 0.55-0.60x the 145 KB tile (H100, forced sm80 path): each half computes S^T
//     and dP^T, 5 of 7 GEMMs useful.
//   hdim 192: one buffer (76 KB). hdim 256: one buffer, and dS^T in Q's buffer once the dK GEMM is done with
//     it (96 KB; dS^T of its own would be 100.25 KB).
struct BwdTileSm80 {
  int block_m;
  int block_n;
  int warps;
  int stages;  // Q / dO buffers (BwdTraitsSm80)
};

constexpr BwdTileSm80 bwd_tile_sm80(int head_dim, bool small_smem = false) {
  return !small_smem        ? (head_dim <= 128 ? BwdTileSm80{64, 128, 8, 2} : BwdTileSm80{32, 64, 8, 2})
         : head_dim <= 64   ? BwdTileSm80{64, 128, 8, 2}
         : head_dim <= 96   ? BwdTileSm80{64, 128, 8, 1}
         : head_dim <= 128  ? BwdTileSm80{32, 128, 8, 1}
                            : BwdTileSm80{32, 64, 8, 1};
}

// Decode (decode/kernel_decode.hpp, one kernel for sm80 and sm90): 16 packed query rows, kBlockN keys a tile
// (kBlockN / 4 per warp, a multiple of 16), kStages cp.async buffers of K + V. Sized so two CTAs fit an SM
// (K + V + Q <= ~110 KB) up to hdim 128, keeping 4-6 tiles of loads in flight per SM; hdim 256 keeps two
// stages (128 KB, one CTA, within the A100's 164 KB). `small_smem` (99 KB a CTA): two stages up to hdim 128
// (66-68 KB; three are 98-100 KB with Q, over the limit once a paged cache's page ring is added). Hdim 256
// has no such row: two 64-key stages are 128 KB and the kernel needs both; the launcher says so and the
// caller runs the forward kernels or the reference.
//
// fp8 caches (`kv8`) stage half the bytes a tile, next to one 16-bit K and V tile they are widened into. A
// tile's latency through a CTA, not the bytes in flight, bounds them (on H100 three or four stages read no
// faster than two), so they keep two stages up to hdim 128: 66-68 KB, three CTAs an SM (decode_splits.h).
// The key block is the 16-bit kernel's: the host's split count assumes it.
struct DecodeTile {
  int block_n;
  int stages;
};

constexpr DecodeTile decode_tile(int head_dim, bool small_smem = false, bool kv8 = false) {
  return head_dim <= 64    ? DecodeTile{128, small_smem || kv8 ? 2 : 3}
         : head_dim <= 128 ? DecodeTile{64, small_smem || kv8 ? 2 : 3}
                           : DecodeTile{64, 2};
}

// One decode CTA's shared memory (16-bit q; the kernel static_asserts it): the main loop's Q, K and V tiles
// (fp8: the 16-bit pair and the fp8 stages), or the epilogue's per-warp merge scratch where larger; a paged
// cache's 4 KB page ring past either.
constexpr int decode_smem_bytes(int head_dim, bool paged, bool kv8, bool small_smem = false) {
  const DecodeTile t = decode_tile(head_dim, small_smem, kv8);
  const int q = 2 * 16 * head_dim, tile = t.block_n * head_dim;
  const int main = q + (kv8 ? 2 * 2 * tile + 2 * t.stages * tile : 2 * t.stages * 2 * tile);
  const int epilogue = q + 4 * (4 * 16 * head_dim + 2 * 4 * 16);
  return (main > epilogue ? main : epilogue) + (paged ? 4096 : 0);
}

}  // namespace flash4
