// Append kernel of attn_with_kvcache: new k, v rows into the cache at cache_seqlens[b] + t, with rotary on k
// (and on q, into AppendParams::q_rot) at the tokens' positions, counted from the sequence's first key
// (cache_leftpad): position = cache_seqlens[b] - leftpad + t. One warp per (sequence, token, head) row.
// Rows that land past the cache's capacity or in a page outside the pool are skipped (lying lengths and page
// ids never write outside the cache).
#pragma once

#include <cute/config.hpp>

#include "../params.h"
#include "kv_source.hpp"

namespace flash4 {

template <class Element>
struct AppendKV {
  static constexpr int kWarps = 4;
  static constexpr int kNumThreads = 32 * kWarps;

  // Rows: k/v rows (batch * seqlen_new * nheads_kv), then q rows when rotary is on (batch * seqlen_q * nheads_q).
  CUTE_HOST_DEVICE static int64_t rows(DecodeParams const& p, AppendParams const& a) {
    return int64_t(p.batch) * p.seqlen_new * p.nheads_kv +
           (a.q_rot != nullptr ? int64_t(p.batch) * p.seqlen_q * p.nheads_q : 0);
  }

  // x rotated at position pos into dst (dst may be x's own row only if no lane reads a partner it wrote: the
  // callers always write a different tensor).
  CUTE_DEVICE static void rotate_row(AppendParams const& a, int pos, const Element* x, Element* dst, int d) {
    const int half = a.rotary_dim / 2;
    pos = min(max(pos, 0), a.seqlen_ro - 1);
    const Element* cos = static_cast<const Element*>(a.cos) + int64_t(pos) * half;
    const Element* sin = static_cast<const Element*>(a.sin) + int64_t(pos) * half;
    for (int i = threadIdx.x % 32; i < d; i += 32) {
      float y = float(x[i]);
      if (i < a.rotary_dim) {
        int j, partner;
        float sign;
        if (a.interleaved) {  // pairs (2j, 2j + 1)
          j = i / 2, partner = i ^ 1, sign = (i & 1) ? 1.f : -1.f;
        } else {  // halves (j, j + rotary_dim / 2)
          j = i % half, partner = i < half ? i + half : i - half, sign = i < half ? -1.f : 1.f;
        }
        y = y * float(cos[j]) + sign * float(x[partner]) * float(sin[j]);
      }
      dst[i] = Element(y);
    }
  }

  template <class KVSource>
  CUTE_DEVICE void run(DecodeParams const& p, AppendParams const& a) const {
    const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    const int64_t kv_rows = int64_t(p.batch) * p.seqlen_new * p.nheads_kv;
    if (row >= rows(p, a)) return;
    const int d = p.head_dim;
    const bool rotary = a.q_rot != nullptr;
    if (row < kv_rows) {
      const int h = int(row % p.nheads_kv), t = int(row / p.nheads_kv % p.seqlen_new);
      const int b = int(row / p.nheads_kv / p.seqlen_new);
      const int used = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : 0;
      const int leftpad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
      if (used < 0 || used >= p.capacity) return;  // a lying length: nothing to write
      const KVRow kr = KVSource::locate(p, KVSource::slab_of(p, b), b, used + t);
      if (!kr.valid) return;
      Element* kdst = const_cast<Element*>(static_cast<const Element*>(p.k)) + int64_t(kr.slab) * p.k_batch_stride +
                      int64_t(kr.row) * p.k_row_stride + int64_t(h) * p.k_head_stride;
      Element* vdst = const_cast<Element*>(static_cast<const Element*>(p.v)) + int64_t(kr.slab) * p.v_batch_stride +
                      int64_t(kr.row) * p.v_row_stride + int64_t(h) * p.v_head_stride;
      const Element* ksrc = static_cast<const Element*>(a.k_new) + int64_t(b) * a.kn_batch_stride +
                            int64_t(t) * a.kn_row_stride + int64_t(h) * a.kn_head_stride;
      const Element* vsrc = static_cast<const Element*>(a.v_new) + int64_t(b) * a.vn_batch_stride +
                            int64_t(t) * a.vn_row_stride + int64_t(h) * a.vn_head_stride;
      if (rotary) {
        rotate_row(a, used - leftpad + t, ksrc, kdst, d);
      } else {
        for (int i = threadIdx.x % 32; i < d; i += 32) kdst[i] = ksrc[i];
      }
      for (int i = threadIdx.x % 32; i < d; i += 32) vdst[i] = vsrc[i];
    } else {
      const int64_t r = row - kv_rows;
      const int h = int(r % p.nheads_q), t = int(r / p.nheads_q % p.seqlen_q), b = int(r / p.nheads_q / p.seqlen_q);
      const int used = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : 0;
      const int leftpad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
      // FlashAttention's rule: query token t at position cache_seqlens - leftpad + t with a causal or window
      // mask (the new tokens' positions), else every query token at cache_seqlens - leftpad.
      const int pos = used - leftpad + (a.q_per_token ? t : 0);
      const Element* src = static_cast<const Element*>(a.q) + int64_t(b) * a.q_batch_stride +
                           int64_t(t) * a.q_row_stride + int64_t(h) * a.q_head_stride;
      Element* dst = static_cast<Element*>(a.q_rot) + ((int64_t(b) * p.seqlen_q + t) * p.nheads_q + h) * d;
      rotate_row(a, pos, src, dst, d);
    }
  }
};

}  // namespace flash4
