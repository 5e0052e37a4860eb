// Host check of persistent_bwd_zero_dq_in_kernel.patch's plan (session 16), on shapes like the tests': every dq_accum
// block is zeroed exactly once (at the start when no key tile or a round-0 tile reaches it first, else by the CTA
// of the lowest key tile that reaches it), and every key tile that reaches a block is launched no earlier than that
// one, so its round is no earlier. Needs the patch applied (TileOrder::linear_of):
//   nvcc -std=c++17 -Icsrc -I$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include \
//     docs/wip/zero_dq_plan_check.cu -o /tmp/zero_dq_plan_check && /tmp/zero_dq_plan_check   # "bad 0"
#include <initializer_list>
#include <cstdio>
#include <vector>
#include "common/tile_order.hpp"
#include "common/block_info.hpp"
// Checks the in-kernel dq_accum zeroing plan of the persistent window backward (kBlockM 64, kBlockN 128).
int main() {
  constexpr int BM = 64, BN = 128;
  long bad = 0, blocks = 0;
  struct Case { int sq, sk, left, right, heads; };
  for (Case c : {Case{32768, 32768, 4096, 0, 16}, Case{1023, 1024, 0, 0, 3}, Case{4000, 4100, 100, 37, 2},
                 Case{5000, 3000, 700, 0, 4}, Case{3000, 5000, 129, 5, 1}, Case{8192, 8192, 2047, 0, 5}}) {
    for (int sms : {132, 7}) {
      flash4::BlockMask<BM, BN, false, true> bm(c.sq, c.sk, c.left, c.right);
      const int nb = (c.sk + BN - 1) / BN, num_m = (c.sq + BM - 1) / BM;
      // tail blocks as the kernel: key blocks whose query range the end of the sequence cuts (approximation:
      // any tail 0..nb is legal for the order; try two)
      for (int tail : {0, nb / 3}) {
        auto o = flash4::TileOrder::make<128>(nb, c.heads, 1, tail);
        const int tiles = nb * c.heads, G = tiles < sms ? tiles : sms;
        for (int h = 0; h < c.heads; ++h) {
          std::vector<int> zeroed(num_m, 0);
          for (int m = 0; m < num_m; ++m) {
            const int lo = bm.n_block_min(m), hi = bm.n_block_max(m);
            if (hi <= lo || o.linear_of(lo, h, 0) / G == 0) zeroed[m]++;
          }
          for (int n = 0; n < nb; ++n) {
            if (o.linear_of(n, h, 0) / G == 0) continue;  // round 0 tiles zero nothing themselves
            for (int m = bm.m_block_max(n) - 1; m >= bm.m_block_min(n) && bm.n_block_min(m) == n; --m) zeroed[m]++;
          }
          for (int m = 0; m < num_m; ++m) {
            ++blocks;
            if (zeroed[m] != 1) { if (bad < 5) printf("zeroed %d times: case sq %d m %d\n", zeroed[m], c.sq, m); ++bad; }
            const int lo = bm.n_block_min(m), hi = bm.n_block_max(m);
            for (int n = lo; n < hi; ++n) {
              // every tile that reaches m is launched no earlier than the owner, and reaches m per its m-range
              if (o.linear_of(n, h, 0) < o.linear_of(lo, h, 0)) ++bad;
              if (!(bm.m_block_min(n) <= m && m < bm.m_block_max(n))) { if (bad < 5) printf("range mismatch\n"); ++bad; }
            }
          }
        }
      }
    }
  }
  printf("blocks %ld bad %ld\n", blocks, bad);
}
