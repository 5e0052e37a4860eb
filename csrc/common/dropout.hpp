// Attention dropout as a score-modifier policy (DESIGN.md, "Kernel variants"): it takes the mainloops' Bias
// slot (a dropout kernel adds no bias) and acts on the probabilities after the exponential. The keep mask is
// flash_attn4/dropout.py's, bit for bit: per (batch, head) a Philox4x32-10 call derives a stream (k0, k1, ci,
// cj) from the call's (seed, offset); then one Philox4x32-7 call per unit {i, i + 1, i + 8, i + 9} x {j, j + 1,
// j + 8, j + 9} (i, j % 16 in {0, 2, 4, 6}) gives sixteen bytes, element (i, j) keeping iff byte
// 2 ((i >> 3) & 1) + ((j >> 3) & 1) of word 2 (i & 1) + (j & 1) is >= the threshold. In an accumulator's rowcol
// view (sm90 WGMMA and sm80 mma.sync alike) a thread holds (r, c), (r + 1, c) = rows x, x + 8 and, per 16
// columns, c .. c + 3 = columns y, y + 1, y + 8, y + 9; the lane four up (lane ^ 4) holds rows x + 1, x + 9 with
// the same columns. That holds whether rows are queries (the forward's S) or keys (the backward's S^T), so a
// unit is half in each lane of a pair in both directions: each lane computes the unit of one of two
// neighbouring 16-column blocks and the lanes trade halves (docs/design.md, "Dropout").
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../params.h"

namespace flash4 {

template <int kRounds>
CUTE_HOST_DEVICE uint4 philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c.x;
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c.z;
    c = make_uint4(uint32_t(p1 >> 32) ^ c.y ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ c.w ^ k1, uint32_t(p0));
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The exchange between the lanes of a pair (lane, lane ^ 4) in the kernels. The host checks pass their own.
struct ShflXor4 {
  CUTE_HOST_DEVICE uint32_t operator()(uint32_t v) const {
#if defined(__CUDA_ARCH__)
    return __shfl_xor_sync(0xffffffffu, v, 4);
#else
    return v;
#endif
  }
};

// The mainloops run at their register limit, so a Dropout holds the (batch, head) index; each tile derives the
// stream from it and the call's (seed, offset) (two loads and a Philox4x32-10 call, a few percent of a tile's
// dropout work), and the threshold and 1 / (1 - p) are read from the kernel parameters where used.
struct Dropout {
  static constexpr bool kEnabled = false;  // no score bias
  static constexpr bool kDrops = true;
  uint32_t bh;  // batch * nheads + head
  uint32_t k0, k1, ci, cj;  // the stream, set by with_stream

  CUTE_HOST_DEVICE static Dropout make(DropoutParams const&, int bidb, int nheads, int bidh) {
    return {uint32_t(bidb * nheads + bidh), 0u, 0u, 0u, 0u};
  }

  // A copy with the stream of this (batch, head), from the call's (seed, offset) on the device.
  CUTE_HOST_DEVICE Dropout with_stream(DropoutParams const& d) const {
    const uint64_t seed = uint64_t(d.rng[0]);
    const uint32_t offset = uint32_t(d.rng[1]);
    const uint4 w = philox4x32<10>(make_uint4(bh, offset, 0u, 0u), uint32_t(seed), uint32_t(seed >> 32));
    return {bh, w.x, w.y, w.z, w.w};
  }

  // u(x): x, x + 1, x + 8, x + 9 share a unit when x % 16 is in {0, 2, 4, 6}.
  CUTE_HOST_DEVICE static uint32_t unit(int x) { return ((uint32_t(x) >> 4) << 2) | ((uint32_t(x) & 7u) >> 1); }

  // The sixteen bytes of the unit (query unit uq, key unit uk) under the stream's keys as for_each_keep passes
  // them (through an empty asm, so the round keys are derived per call, not held across the loop).
  CUTE_HOST_DEVICE uint4 unit_bits(uint32_t uq, uint32_t uk, uint32_t k0_, uint32_t k1_) const {
    return philox4x32<7>(make_uint4(uq, ci, uk, cj), k0_, k1_);
  }

  // Calls f(r, c, kept) for every element of a rowcol tile with origin (row0, col0), rows = queries
  // (kRowsAreQueries) or keys. tC gives this thread's coordinates, tC0 thread 0's: a thread's coordinates are its
  // first one plus offsets that are the same in every thread, so with thread 0's they fold to immediates (held
  // per element, the coordinates spilled the backward). Needs the stream (with_stream). Every lane of the warp
  // must call it together (swap is a shuffle).
  //
  // Per row pair and two 16-column blocks, this lane computes the unit of block `odd` (its row parity) and
  // swaps the half its partner holds for the partner's unit's half it holds; a last unpaired block is computed by
  // both. Each unit's keys pass through an empty asm that also takes the previous unit's result, so one Philox
  // chain (8-10 registers) is in flight at a time.
  template <bool kRowsAreQueries, class TC, class TC0, class F, class Swap = ShflXor4>
  CUTE_HOST_DEVICE void for_each_keep(TC const& tC, TC0 const& tC0, int row0, int col0, uint32_t threshold, F&& f,
                                      Swap&& swap = Swap{}) const {
    using cute::get;
    const int row_thr = row0 + get<0>(tC(0, 0)) - get<0>(tC0(0, 0));
    const int col_thr = col0 + get<1>(tC(0, 0)) - get<1>(tC0(0, 0));
    constexpr int kR = decltype(cute::size<0>(tC))::value, kC = decltype(cute::size<1>(tC))::value;
    static_assert(kR % 2 == 0 && kC % 4 == 0, "units are 2 rows x 2 column pairs of an accumulator");
    constexpr int kBlocks = kC / 4;  // 16-column blocks
    const bool odd = (row_thr & 1) != 0;
    // Thread 0's column at the start of every block is a multiple of 16, so a block's unit is this thread's
    // first one plus 4 per 16 columns (the host check, tests/cpp/test_dropout_bits.cpp, walks the real layouts).
    const uint32_t col_unit0 = unit(col_thr);
    const uint32_t thr = threshold << 24;  // byte b of w is >= threshold iff w << (24 - 8 b) >= thr
    uint32_t last = 0u;
    // Word x (the column's parity) of the half of a unit with row parity `half`: words are indexed
    // 2 (query & 1) + (key & 1).
    auto word = [](uint4 const& w, int half, int x) {
      const int q = kRowsAreQueries ? half : x, k = kRowsAreQueries ? x : half;
      const int i = 2 * q + k;
      return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
    };
    auto apply = [&](int r, int b, uint32_t w0, uint32_t w1) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int dr = e >> 2, dc = (e >> 1) & 1, x = e & 1;  // +8 row, +8 column, column parity
        const int byte = kRowsAreQueries ? 2 * dr + dc : 2 * dc + dr;
        const uint32_t w = x ? w1 : w0;
        f(r + dr, 4 * b + 2 * dc + x, (w << (24 - 8 * byte)) >= thr);
      }
    };
#pragma unroll
    for (int r = 0; r < kR; r += 2) {
      const uint32_t row_unit = unit(row_thr + get<0>(tC0(r, 0)));
#pragma unroll
      for (int b = 0; b < kBlocks; b += 2) {
        constexpr int kNone = -1;
        const int b_hi = b + 1 < kBlocks ? b + 1 : kNone;
        const uint32_t u_lo = col_unit0 + 4u * uint32_t(get<1>(tC0(r, 4 * b)) >> 4);
        const uint32_t u_hi = b_hi == kNone ? u_lo : col_unit0 + 4u * uint32_t(get<1>(tC0(r, 4 * b_hi)) >> 4);
        const uint32_t col_unit = odd ? u_hi : u_lo;
        uint32_t k0_ = k0, k1_ = k1;
        asm volatile("" : "+r"(k0_), "+r"(k1_) : "r"(last));
        const uint4 w = kRowsAreQueries ? unit_bits(row_unit, col_unit, k0_, k1_)
                                        : unit_bits(col_unit, row_unit, k0_, k1_);
        last = w.x ^ w.w;
        if (b_hi == kNone) {
          apply(r, b, odd ? word(w, 1, 0) : word(w, 0, 0), odd ? word(w, 1, 1) : word(w, 0, 1));
        } else {
          // Lane 0 of the pair keeps half 0 of block b's unit and sends half 1; lane 1 keeps half 1 of block
          // b_hi's and sends half 0.
          const uint32_t got0 = swap(odd ? word(w, 0, 0) : word(w, 1, 0));
          const uint32_t got1 = swap(odd ? word(w, 0, 1) : word(w, 1, 1));
          apply(r, b, odd ? got0 : word(w, 0, 0), odd ? got1 : word(w, 0, 1));
          apply(r, b_hi, odd ? word(w, 1, 0) : got0, odd ? word(w, 1, 1) : got1);
        }
      }
    }
  }

  // The forward: x = kept ? x : 0 (the 1 / (1 - p) rides in the final normalization).
  template <bool kRowsAreQueries, class TS, class TC, class TC0>
  CUTE_DEVICE void drop(TS& x, TC const& tC, TC0 const& tC0, int row0, int col0, uint32_t threshold) const {
    for_each_keep<kRowsAreQueries>(tC, tC0, row0, col0, threshold,
                                   [&](int r, int c, bool kept) { x(r, c) = kept ? x(r, c) : 0.f; });
  }
};

}  // namespace flash4
