// Where a sequence's keys live (DESIGN.md: the "K/V source" policy of the decode kernels) and which of them a
// call attends. Both sources answer the same question, "where is key row t of sequence b", so the loads, the
// append kernel and the lying-value rules are written once.
#pragma once

#include <cute/config.hpp>
#include <cute/arch/util.hpp>

#include "../params.h"

namespace flash4 {

// A key row: its slab (cache row, or page) and the row inside it; `valid` false means "read zeros, write
// nothing" (a page id outside the pool, or a row past the capacity).
struct KVRow {
  int slab;
  int row;
  bool valid;
};

// (cache_batch, capacity, heads, d): sequence b reads cache row cache_batch_idx[b] (clamped into the cache).
struct ContiguousKV {
  static constexpr bool kPaged = false;
  CUTE_DEVICE static int slab_of(DecodeParams const& p, int b) {
    const int s = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    return min(max(s, 0), p.cache_batch - 1);
  }
  CUTE_DEVICE static KVRow locate(DecodeParams const& p, int slab, int b, int t) {
    return {slab, t, t >= 0 && t < p.capacity};
  }
};

// The page of key row t: a shift for power-of-two page sizes (every size in common use), which the loads
// compute for every row they issue; a division otherwise.
CUTE_DEVICE int page_of(DecodeParams const& p, int t) {
  return p.page_shift >= 0 ? t >> p.page_shift : t / p.page_size;
}

// (num_pages, page_size, heads, d) + page_table (batch, max_pages): any page size from 1 up.
struct PagedKV {
  static constexpr bool kPaged = true;
  CUTE_DEVICE static int slab_of(DecodeParams const&, int b) { return b; }
  CUTE_DEVICE static KVRow locate(DecodeParams const& p, int, int b, int t) {
    if (t < 0 || t >= p.capacity) return {0, 0, false};
    const int g = page_of(p, t);
    const int page = p.page_table[int64_t(b) * p.page_table_stride + g];
    const bool valid = page >= 0 && page < p.num_pages;
    return {valid ? page : 0, t - g * p.page_size, valid};
  }
};

// A paged CTA's page ids, staged in shared memory ahead of the loads that need them: page-table reads then
// never sit between a free K / V buffer and its cp.async (a dependent global load costs about a
// microsecond under full HBM load, about one tile's worth of streaming). Slot (g - g0) % kSize holds the id of
// page g of the sequence, g0 being the CTA's first page. `refill` keeps the ids of the next kSize / 2 pages
// past the current tile's first page issued; a refill overwrites only slots of pages before that first page,
// which no thread reads again, and lands many tiles before its first reader (the main loop's per-tile
// cp.async wait and barrier publish it). Ids past the page table row read as 0 and are never used: rows past
// the capacity are invalid before the ring is read.
struct PageRing {
  static constexpr int kSize = 1024;  // ids; a power of two, >= 2 x (pages of one tile + 1) for page size 1
  int* slots;
  const int* row;  // page_table row of sequence b
  int g0, issued;  // first page of the CTA; pages issued so far, relative to g0

  CUTE_DEVICE PageRing(int* smem, DecodeParams const& p, int b, int first_key)
      : slots(smem), row(p.page_table + int64_t(b) * p.page_table_stride), g0(0), issued(0) {
    if (p.page_table != nullptr) g0 = first_key / p.page_size;
  }
  // Issues (cp.async, in the caller's next commit group) the ids of the next `count` pages.
  CUTE_DEVICE void fill(DecodeParams const& p, int count) {
    const int max_pages = p.capacity / p.page_size;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      const int g = g0 + issued + i;
      const uint32_t dst = cute::cast_smem_ptr_to_uint(slots + ((issued + i) & (kSize - 1)));
      const int* src = row + (g < max_pages ? g : 0);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(g < max_pages ? 4 : 0));
    }
    issued += count;
  }
  CUTE_DEVICE void refill(DecodeParams const& p, int tile_first_key) {
    if (issued < page_of(p, tile_first_key) - g0 + kSize / 2) fill(p, kSize / 2);
  }
  CUTE_DEVICE KVRow locate(DecodeParams const& p, int t) const {
    if (t < 0 || t >= p.capacity) return {0, 0, false};
    const int g = page_of(p, t);
    const int page = slots[(g - g0) & (kSize - 1)];
    return {page >= 0 && page < p.num_pages ? page : 0, t - g * p.page_size, page >= 0 && page < p.num_pages};
  }
};

// The keys one sequence attends: absolute cache rows [key_begin, key_end), the query rows' positions counted
// from key_begin (bottom-right aligned: the last query token sits at key_end - 1). Every device-side value is
// clamped here, so lying lengths compute something documented and never address outside the cache.
struct DecodeSeq {
  int key_begin, key_end;
  CUTE_DEVICE int seqlen_k() const { return key_end - key_begin; }
};

CUTE_DEVICE DecodeSeq decode_seq(DecodeParams const& p, int b) {
  const int used = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.capacity - p.seqlen_new;
  const int end = min(min(max(used, 0), p.capacity) + p.seqlen_new, p.capacity);
  const int begin = p.cache_leftpad != nullptr ? min(max(p.cache_leftpad[b], 0), end) : 0;
  return {begin, end};
}

}  // namespace flash4
