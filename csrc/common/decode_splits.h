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
// sequence; num_sms: the GPU's SMs; paged: the keys come from a paged cache.
//   * A contiguous cache streams at full bandwidth with about one CTA per SM (measured on H200: 16 x 8 KV
//     heads unsplit reads as fast as split 2 or 4 ways), so splitting stops once the CTAs cover the SMs:
//     more slices add partial writes, combine reads and a wave tail for nothing.
//   * A paged cache's rows are scattered (a page of 16 rows is 4 KB of one head), so each load waits
//     longer and one CTA per SM reaches only about half the bandwidth; two per SM recover it.
//   * Below that, s = target / ctas slices (rounded down: the last partial wave would run alone).
//   * Each slice keeps at least kMinBlocksPerSplit tiles, so its pipeline reaches a steady state.
constexpr int kMaxDecodeSplits = 128;
constexpr int kMinBlocksPerSplit = 4;

inline int decode_num_splits(int ctas, int n_blocks, int num_sms, bool paged) {
  const int target = paged ? 2 * num_sms : num_sms;
  if (ctas <= 0 || num_sms <= 0 || ctas >= target) return 1;
  const int s = std::min({target / ctas, n_blocks / kMinBlocksPerSplit, kMaxDecodeSplits});
  return std::max(s, 1);
}

}  // namespace flash4
