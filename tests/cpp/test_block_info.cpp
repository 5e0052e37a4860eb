// Host-side check of common/block_info.hpp against brute force (compiled and run by tests/test_block_info.py):
// block ranges cover every visible (query, key) pair, blocks said to need no mask have no masked pair, and the
// key blocks that add into a query block in the backward are exactly the forward's range for it (the
// deterministic turn order depends on that: a gap would make a CTA wait forever).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <utility>

#include "common/block_info.hpp"

using flash4::BlockMask;

static int failures = 0;
#define CHECK(cond, ...)                     \
  do {                                       \
    if (!(cond)) {                           \
      if (++failures <= 20) {                \
        std::printf("FAIL %s: ", #cond);     \
        std::printf(__VA_ARGS__);            \
        std::printf("\n");                   \
      }                                      \
    }                                        \
  } while (0)

template <int M, int N, bool kCausal, bool kLocal>
void check(int sq, int sk, int left, int right) {
  const BlockMask<M, N, kCausal, kLocal> bm(sq, sk, left, right);
  const int off = sk - sq;
  auto visible = [&](int i, int j) {
    if (j < 0 || j >= sk) return false;
    if (kCausal && j > i + off) return false;
    if (kLocal && (j > i + off + right || j < i + off - left)) return false;
    return true;
  };
  const int m_blocks = (sq + M - 1) / M, n_blocks = (sk + N - 1) / N;
  // Whether tile (m, n) holds any visible pair, and whether all its pairs (real query rows) are visible.
  auto scan = [&](int m, int n) {
    bool any = false, all = true;
    for (int i = m * M; i < std::min(sq, (m + 1) * M); ++i) {
      for (int j = n * N; j < (n + 1) * N; ++j) {
        const bool v = visible(i, j);
        any |= v;
        all &= v;
      }
    }
    return std::pair<bool, bool>{any, all};
  };
  for (int i = 0; i < sq; ++i) {
    for (int j = 0; j < sk; ++j) CHECK(bm.masked(i, j) == !visible(i, j), "sq %d sk %d i %d j %d", sq, sk, i, j);
  }
  // Forward: range and masks per query tile.
  for (int m = 0; m < m_blocks; ++m) {
    const int lo = bm.n_block_min(m), hi = bm.n_block_max(m);
    const int right_min = bm.n_block_right_mask_min(m), left_max = bm.n_block_left_mask_max(m);
    for (int n = 0; n < n_blocks; ++n) {
      const auto [any, all] = scan(m, n);
      if (any) CHECK(lo <= n && n < hi, "fwd range: M %d N %d sq %d sk %d l %d r %d m %d n %d [%d,%d)", M, N, sq, sk,
                     left, right, m, n, lo, hi);
      // In the forward only the first visited block masks the key end; the others rely on these two bounds.
      const bool unmasked = !(BlockMask<M, N, kCausal, kLocal>::kHasRight && n >= right_min) &&
                            !(kLocal && n < left_max) && n != hi - 1;
      if (lo <= n && n < hi && unmasked) {
        CHECK(all, "fwd unmasked block has a masked pair: M %d N %d sq %d sk %d l %d r %d m %d n %d", M, N, sq, sk,
              left, right, m, n);
      }
    }
  }
  // Backward: range and masks per key block; participants per query block.
  for (int n = 0; n < n_blocks; ++n) {
    const int lo = bm.m_block_min(n), hi = bm.m_block_max(n);
    for (int m = 0; m < m_blocks; ++m) {
      const auto [any, all] = scan(m, n);
      if (any) CHECK(lo <= m && m < hi, "bwd range: M %d N %d sq %d sk %d l %d r %d n %d m %d", M, N, sq, sk, left, right,
                     n, m);
      if (lo <= m && m < hi && !bm.tile_needs_mask(m, n)) {
        CHECK(all, "bwd unmasked tile has a masked pair: M %d N %d sq %d sk %d n %d m %d", M, N, sq, sk, n, m);
      }
    }
  }
  for (int m = 0; m < m_blocks; ++m) {
    int count = 0, first = -1, last = -1;
    for (int n = 0; n < n_blocks; ++n) {
      if (bm.m_block_min(n) <= m && m < bm.m_block_max(n)) {
        if (first < 0) first = n;
        CHECK(last < 0 || last == n - 1, "participants not contiguous: sq %d sk %d m %d n %d", sq, sk, m, n);
        last = n;
        ++count;
      }
    }
    const int lo = std::max(0, bm.n_block_min(m)), hi = std::min(n_blocks, bm.n_block_max(m));
    if (count > 0) {
      CHECK(first == lo && last == hi - 1, "participants [%d,%d] != fwd range [%d,%d): M %d N %d sq %d sk %d l %d r %d m %d",
            first, last, lo, hi, M, N, sq, sk, left, right, m);
    } else {
      CHECK(hi <= lo, "no participant but fwd range [%d,%d): sq %d sk %d m %d", lo, hi, sq, sk, m);
    }
  }
}

int main() {
  std::mt19937 rng(1234);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int it = 0; it < 300; ++it) {
    const int sq = rnd(1, 600), sk = rnd(1, 600);
    const int big = sq + sk + 1;  // "unbounded", as the binding passes it
    int left = rnd(0, 3) == 0 ? big : rnd(0, 300), right = rnd(0, 3) == 0 ? big : rnd(0, 300);
    if (rnd(0, 4) == 0) right = 0;  // causal + left window
    check<128, 128, false, false>(sq, sk, 0, 0);
    check<128, 128, true, false>(sq, sk, 0, 0);
    check<128, 128, false, true>(sq, sk, left, right);
    check<128, 176, true, false>(sq, sk, 0, 0);
    check<128, 176, false, true>(sq, sk, left, right);
    check<64, 128, true, false>(sq, sk, 0, 0);
    check<64, 128, false, true>(sq, sk, left, right);
    check<64, 64, false, true>(sq, sk, left, right);
  }
  std::printf(failures ? "%d FAILURES\n" : "block_info: all checks passed\n", failures);
  return failures ? 1 : 0;
}
