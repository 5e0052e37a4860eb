// Attention dropout as a score-modifier policy (DESIGN.md, "Kernel variants"): it takes the mainloops' Bias
// slot (a dropout kernel adds no bias) and acts on the probabilities after the exponential. The keep mask is
// flash_attn4/dropout.py's, bit for bit: per (batch, head) a Philox4x32 call derives a stream (key, ci, cj)
// from the call's (seed, offset); then one Philox2x32 call per unit {i, i + 8} x {j, j + 8} (i, j % 16 < 8)
// gives four 16-bit numbers, element (i, j) keeping iff field (j >> 3) & 1 of word (i >> 3) & 1 is >= the
// threshold. In an accumulator's rowcol view (sm90 WGMMA and sm80 mma.sync alike) those four elements are one
// thread's (r, c), (r + 1, c), (r, c + 2), (r + 1, c + 2) for even r and c % 4 < 2, whether rows are queries
// (the forward's S) or keys (the backward's S^T), so each thread computes exactly the bits it uses.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../params.h"

namespace flash4 {

CUTE_HOST_DEVICE uint2 philox2x32_10(uint32_t c0, uint32_t c1, uint32_t key) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint64_t prod = uint64_t(0xD256D193u) * c0;
    c0 = uint32_t(prod >> 32) ^ key ^ c1;
    c1 = uint32_t(prod);
    key += 0x9E3779B9u;
  }
  return make_uint2(c0, c1);
}

CUTE_HOST_DEVICE uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c.x;
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c.z;
    c = make_uint4(uint32_t(p1 >> 32) ^ c.y ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ c.w ^ k1, uint32_t(p0));
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The mainloops run at their register limit, so a Dropout holds one register, the (batch, head) index; each
// tile derives the stream from it and the call's (seed, offset) (two loads and a Philox4x32 call, about a tenth
// of a tile's dropout work), and the threshold and 1 / (1 - p) are read from the kernel parameters where used.
struct Dropout {
  static constexpr bool kEnabled = false;  // no score bias
  static constexpr bool kDrops = true;
  uint32_t bh;  // batch * nheads + head
  uint32_t key, ci, cj;  // the stream, set by with_stream

  CUTE_HOST_DEVICE static Dropout make(DropoutParams const&, int bidb, int nheads, int bidh) {
    return {uint32_t(bidb * nheads + bidh), 0u, 0u, 0u};
  }

  // A copy with the stream of this (batch, head), from the call's (seed, offset) on the device.
  CUTE_HOST_DEVICE Dropout with_stream(DropoutParams const& d) const {
    const uint64_t seed = uint64_t(d.rng[0]);
    const uint32_t offset = uint32_t(d.rng[1]);
    const uint4 w = philox4x32_10(make_uint4(bh, offset, 0u, 0u), uint32_t(seed), uint32_t(seed >> 32));
    return {bh, w.x, w.y, w.z};
  }

  // The unit of (query i0, key j0), i0 % 16 < 8 and j0 % 16 < 8, under the stream's key as for_each_keep
  // passes it (through an empty asm, so the ten round keys are derived per call, not held across the loop).
  CUTE_HOST_DEVICE uint2 unit_bits(int i0, int j0, uint32_t key_) const {
    auto unit = [](int x) { return ((uint32_t(x) >> 4) << 3) | (uint32_t(x) & 7u); };
    return philox2x32_10(unit(i0) ^ ci, unit(j0) ^ cj, key_);
  }

  // Calls f(r, c, kept) for every element of a rowcol tile with origin (row0, col0), rows = queries
  // (kRowsAreQueries) or keys. tC gives this thread's coordinates, tC0 thread 0's: a thread's coordinates are its
  // first one plus offsets that are the same in every thread, so with thread 0's they fold to immediates (held
  // per element, the coordinates spilled the backward). Needs the stream (with_stream).
  //
  // At most kChains units are in flight: each unit's key passes through an empty asm that also takes the result
  // of the unit kChains before it, which bounds the registers a tile's Philox chains (3-4 each) can take.
  template <bool kRowsAreQueries, int kChains = 2, class TC, class TC0, class F>
  CUTE_HOST_DEVICE void for_each_keep(TC const& tC, TC0 const& tC0, int row0, int col0, uint32_t threshold,
                                 F&& f) const {
    using cute::get;
    const int row_thr = row0 + get<0>(tC(0, 0)) - get<0>(tC0(0, 0));
    const int col_thr = col0 + get<1>(tC(0, 0)) - get<1>(tC0(0, 0));
    constexpr int kR = decltype(cute::size<0>(tC))::value, kC = decltype(cute::size<1>(tC))::value;
    static_assert(kR % 2 == 0 && kC % 4 == 0, "units are 2 rows x 2 column pairs of an accumulator");
    uint32_t key_[kChains], last[kChains];
#pragma unroll
    for (int k = 0; k < kChains; ++k) key_[k] = key, last[k] = 0u;
    int unit_idx = 0;
#pragma unroll
    for (int r = 0; r < kR; r += 2) {
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        if (c % 4 >= 2) continue;
        const int row = row_thr + get<0>(tC0(r, c)), col = col_thr + get<1>(tC0(r, c));
        const int chain = unit_idx++ % kChains;
        asm volatile("" : "+r"(key_[chain]) : "r"(last[chain]));
        const uint2 w = kRowsAreQueries ? unit_bits(row, col, key_[chain]) : unit_bits(col, row, key_[chain]);
        last[chain] = w.x ^ w.y;
        // Word: the query's +8; half: the key's +8.
        const int r1 = kRowsAreQueries ? r : r + 1, c1 = kRowsAreQueries ? c + 2 : c;  // (+0, +8)
        const int r2 = kRowsAreQueries ? r + 1 : r, c2 = kRowsAreQueries ? c : c + 2;  // (+8, +0)
        f(r, c, (w.x & 0xFFFFu) >= threshold);
        f(r1, c1, (w.x >> 16) >= threshold);
        f(r2, c2, (w.y & 0xFFFFu) >= threshold);
        f(r + 1, c + 2, (w.y >> 16) >= threshold);
      }
    }
  }

  // The forward: x = kept ? x * scale : 0.
  template <bool kRowsAreQueries, class TS, class TC, class TC0>
  CUTE_DEVICE void drop(TS& x, TC const& tC, TC0 const& tC0, int row0, int col0, uint32_t threshold,
                        float scale) const {
    for_each_keep<kRowsAreQueries>(tC, tC0, row0, col0, threshold,
                                   [&](int r, int c, bool kept) { x(r, c) = kept ? x(r, c) * scale : 0.f; });
  }

};

}  // namespace flash4
