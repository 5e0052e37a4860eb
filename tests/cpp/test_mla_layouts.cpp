// Host-side check of the MLA traits (q / k head dim 192, v head dim 128), compiled with nvcc and run by
// tests/test_mla_dims.py. It walks the real CuTe layouts and thread partitions and prints "ok" or what failed:
//   forward: P V's accumulator (128 x 128 over the 256 consumer threads) covers every O element once, and O,
//     written over Q's buffer, puts each row only on bytes of the same warpgroup's 64 Q rows (the epilogue
//     relies on it: a warpgroup overwrites its own Q rows once its last Q K^T is done);
//   backward: dV's accumulator (64 keys x 128, the warpgroups' 64-column halves) and dK's (64 x 192) cover
//     their tiles once; dO^T's view addresses the same bytes as dO; V's and dO's buffers are v-sized.
#include <cstdio>
#include <map>
#include <set>
#include <utility>

#include <cutlass/numeric_types.h>

#include "sm90/kernel_traits_bwd_sm90.hpp"
#include "sm90/kernel_traits_fwd_sm90.hpp"

using namespace cute;

static int failures = 0;
#define CHECK(cond, ...)                \
  do {                                  \
    if (!(cond)) {                      \
      std::printf("FAIL: " __VA_ARGS__); \
      std::printf("\n");                \
      ++failures;                       \
    }                                   \
  } while (0)

// Every (row, col) of a rows x cols tile is some thread's accumulator element exactly once.
template <class TiledMma, int kRows, int kCols>
void covers_once(const char* name, int threads) {
  TiledMma mma;
  std::map<std::pair<int, int>, int> seen;
  for (int t = 0; t < threads; ++t) {
    Tensor c = mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
    for (int i = 0; i < size(c); ++i) ++seen[{int(get<0>(c(i))), int(get<1>(c(i)))}];
  }
  CHECK(int(seen.size()) == kRows * kCols, "%s: %d of %d elements covered", name, int(seen.size()), kRows * kCols);
  for (auto const& [rc, n] : seen) {
    CHECK(n == 1, "%s: (%d, %d) held by %d threads", name, rc.first, rc.second, n);
    if (n != 1) break;
  }
}

int main() {
  using Element = cutlass::bfloat16_t;
  // The launchers' tiles: forward 128 x 128, two stages; backward (wide) 64 x 64, two stages.
  using Fwd = flash4::FwdTraitsSm90<Element, 192, 128, 128, 2, Element, 128>;
  using Bwd = flash4::BwdWideTraitsSm90<Element, 192, 64, 64, 2, 128>;

  covers_once<typename Fwd::TiledMmaPV, 128, 128>("fwd O", 256);
  {
    typename Fwd::SmemLayoutQ q;
    typename Fwd::SmemLayoutO o;
    std::map<int, int> row_of;  // Q's element offset -> its row
    for (int r = 0; r < 128; ++r)
      for (int c = 0; c < 192; ++c) row_of[int(q(r, c))] = r;
    for (int r = 0; r < 128; ++r) {
      for (int c = 0; c < 128; ++c) {
        auto it = row_of.find(int(o(r, c)));
        CHECK(it != row_of.end(), "fwd: O(%d, %d) lies outside Q's buffer", r, c);
        if (it != row_of.end()) CHECK(it->second / 64 == r / 64, "fwd: O(%d, %d) lands on Q row %d", r, c, it->second);
      }
    }
  }
  CHECK(Fwd::kTmaBytesK == 128 * 192 * 2 && Fwd::kTmaBytesV == 128 * 128 * 2, "fwd: K / V transaction bytes");

  covers_once<typename Bwd::TiledMmadV, 64, 128>("bwd dV", 256);
  covers_once<typename Bwd::TiledMmadKV, 64, 192>("bwd dK", 256);
  {
    typename Bwd::SmemLayoutdO d;
    typename Bwd::SmemLayoutdOt dt;
    std::set<int> offsets;
    for (int s = 0; s < 2; ++s)
      for (int r = 0; r < 64; ++r)
        for (int c = 0; c < 128; ++c) {
          CHECK(int(d(r, c, s)) == int(dt(c, r, s)), "bwd: dO(%d, %d, %d) != dO^T view", r, c, s);
          offsets.insert(int(d(r, c, s)));
        }
    CHECK(int(offsets.size()) == 2 * 64 * 128 && int(cosize(d)) == 2 * 64 * 128, "bwd: dO is not a 2 x 64 x 128 tile");
  }
  CHECK(int(cosize(typename Bwd::SmemLayoutV{})) == 64 * 128, "bwd: V is not 64 x 128");
  CHECK(Bwd::kTmaBytesKV == 64 * (192 + 128) * 2, "bwd: K + V transaction bytes");
  CHECK(Bwd::kTmaBytesQdO == 64 * (192 + 128) * 2 + 2 * 64 * 4, "bwd: Q + dO + rows transaction bytes");
  std::printf("smem fwd %d bwd %d\n", Fwd::kSmemBytes, Bwd::kSmemBytes);
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
