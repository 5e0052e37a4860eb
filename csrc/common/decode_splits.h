// How many slices the decode kernel cuts a sequence's keys into (num_splits = 0, "choose"): a pure host
// function of the launch geometry, so a captured CUDA graph replays with the same choice. docs/design.md
// ("Decoding") has the measurements behind it.
#pragma once

#include <algorithm>

#if defined(__CUDACC__)
#define FLASH4_HOST_DEVICE __host__ __device__
#else
#define FLASH4_HOST_DEVICE
#endif

namespace flash4 {

// The decode kernel packs a KV head's query rows (seqlen_q tokens x group query heads sharing it) into tiles
// of kDecodeBlockM rows (one m16 MMA); the grid has decode_m_blocks of them per (KV head, sequence, split).
constexpr int kDecodeBlockM = 16;

FLASH4_HOST_DEVICE constexpr int decode_m_blocks(int seqlen_q, int group) {
  return (seqlen_q * group + kDecodeBlockM - 1) / kDecodeBlockM;
}

// ctas: CTAs without splitting (query-row blocks x KV heads x sequences); n_blocks: key tiles of the longest
// sequence; num_sms: the GPU's SMs; per_sm: the CTAs per SM to aim for (decode_ctas_per_sm).
//   * Below ctas = per_sm x num_sms, s = per_sm x num_sms / ctas slices (rounded down: the last partial
//     wave would run alone); at or above it, none: more slices add partial writes, combine reads and a wave
//     tail for nothing.
//   * Each slice keeps at least kMinBlocksPerSplit tiles, so its pipeline reaches a steady state.
constexpr int kMaxDecodeSplits = 128;
constexpr int kMinBlocksPerSplit = 4;

inline int decode_num_splits(int ctas, int n_blocks, int num_sms, int per_sm) {
  const int target = per_sm * num_sms;
  if (ctas <= 0 || num_sms <= 0 || ctas >= target) return 1;
  const int s = std::min({target / ctas, n_blocks / kMinBlocksPerSplit, kMaxDecodeSplits});
  return std::max(s, 1);
}

// How many decode CTAs an SM should run at once. smem: one CTA's shared memory (tile_size.h,
// decode_smem_bytes); smem_per_block: the device's opt-in limit (an SM holds 1 KB more, and 1 KB a CTA).
//   * A contiguous 16-bit cache streams at full bandwidth with one (measured on H200: 16 x 8 KV heads unsplit
//     reads as fast as split 2 or 4 ways).
//   * A paged cache's rows are scattered (a page of 16 rows is 4 KB of one head), so each load waits
//     longer and one CTA per SM reaches only about half the bandwidth; two recover it.
//   * An fp8 cache's tile is half the bytes while its latency through a CTA (widening to 16 bits included)
//     is about a 16-bit tile's, so one CTA per SM reads about half the bandwidth: as many as fit, up to
//     three (docs/design.md, "fp8 caches", has the measurements).
inline int decode_ctas_per_sm(bool paged, bool kv8, int smem, int smem_per_block) {
  if (!kv8) return paged ? 2 : 1;
  return std::clamp((smem_per_block + 1024) / (smem + 1024), 1, 3);
}

}  // namespace flash4
