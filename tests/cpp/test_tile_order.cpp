// Host check of csrc/common/tile_order.hpp: the grouped launch order of masked grids is a bijection onto the
// (block, head, batch) tiles, every head sees its blocks in launch order 0, 1, 2, ... (what the deterministic
// backward's reversed key order relies on: key block n + 1 launches before n), groups are balanced, and a
// group's tiles are contiguous in launch order; with tail blocks (sliding windows), the same bijection and
// per-head order, and every tail tile after every other tile. The backward's order (make_bwd) keeps all of that,
// with a quarter of the forward's tiles a group at head dims 64 and 128 without GQA.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/tile_order.hpp"

static int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      if (failures++ < 20) {              \
        std::printf("FAIL: " __VA_ARGS__); \
        std::printf("\n");                \
      }                                   \
    }                                     \
  } while (0)

// gqa > 0: the backward's order for that GQA ratio.
template <int kHeadDim>
void check(int blocks, int heads, int batch, int tail = 0, int gqa = 0) {
  const int total = blocks * heads * batch;
  std::vector<int> seen(total, 0), next_block(heads * batch, 0);
  const flash4::TileOrder order = gqa > 0 ? flash4::TileOrder::make_bwd<kHeadDim>(blocks, heads, batch, tail, gqa)
                                          : flash4::TileOrder::make<kHeadDim>(blocks, heads, batch, tail);
  for (int linear = 0; linear < total; ++linear) {
    const flash4::TileCoord t = order(linear);
    CHECK((t.block >= blocks - tail) == (linear >= (blocks - tail) * heads * batch),
          "d%d %dx%dx%d tail %d: linear %d -> block %d on the wrong side of the tail", kHeadDim, blocks, heads,
          batch, tail, linear, t.block);
    CHECK(t.block >= 0 && t.block < blocks && t.head >= 0 && t.head < heads && t.batch >= 0 && t.batch < batch,
          "out of range d%d %dx%dx%d linear %d -> (%d,%d,%d)", kHeadDim, blocks, heads, batch, linear, t.block,
          t.head, t.batch);
    if (failures) return;
    const int hb = t.batch * heads + t.head;
    seen[(hb * blocks) + t.block]++;
    CHECK(t.block == next_block[hb], "d%d %dx%dx%d: head-batch %d got block %d, expected %d", kHeadDim, blocks,
          heads, batch, hb, t.block, next_block[hb]);
    next_block[hb] = t.block + 1;
  }
  for (int i = 0; i < total; ++i) {
    CHECK(seen[i] == 1, "d%d %dx%dx%d: tile %d seen %d times", kHeadDim, blocks, heads, batch, i, seen[i]);
  }
  if (tail > 0) return;
  // Balanced, contiguous groups: walking the launch order, the set of head-batches in flight changes only at
  // group boundaries, and group sizes differ by at most one.
  std::vector<int> sizes;
  int linear = 0;
  while (linear < total) {
    int size = 0;
    while (linear + size < total &&
           order(linear + size).block == 0) {
      ++size;
    }
    CHECK(size > 0, "empty group at %d", linear);
    if (size == 0) return;
    sizes.push_back(size);
    linear += size * blocks;
  }
  CHECK(linear == total, "d%d %dx%dx%d: groups do not tile the grid", kHeadDim, blocks, heads, batch);
  int lo = total, hi = 0;
  for (int s : sizes) lo = s < lo ? s : lo, hi = s > hi ? s : hi;
  CHECK(hi - lo <= 1, "d%d %dx%dx%d: group sizes %d..%d", kHeadDim, blocks, heads, batch, lo, hi);
}

int main() {
  const int blocks[] = {1, 2, 3, 7, 8, 16, 31, 32, 64, 100, 256, 513};
  const int heads[] = {1, 2, 3, 5, 16, 32, 48};
  const int batches[] = {1, 2, 3, 8};
  int cases = 0;
  for (int n : blocks)
    for (int h : heads)
      for (int b : batches) {
        check<64>(n, h, b);
        check<128>(n, h, b);
        check<256>(n, h, b);
        check<256>(n, h, b, 0, 2);
        for (int gqa : {1, 4, 8}) check<64>(n, h, b, 0, gqa), check<128>(n, h, b, 0, gqa);
        for (int tail : {1, n / 3, n - 1, n}) {
          if (tail < 1 || tail > n) continue;
          check<128>(n, h, b, tail);
          check<128>(n, h, b, tail, 4);
          cases += 2;
        }
        cases += 10;
      }
  // Group sizes in head-batches: 1k tokens (8 blocks), 32 heads, batch 16, head dim 64. The forward's 32 MB of
  // K / V hold 128 head-batches, the backward's 16 MB of Q / dO / dq_accum 32 (without GQA; tile_order.hpp says
  // why GQA and the other head dims keep the forward's).
  const auto first_group = [](flash4::TileOrder const& o) {
    int size = 0;
    while (o(size).block == 0) ++size;
    return size;
  };
  CHECK(first_group(flash4::TileOrder::make<64>(8, 32, 16)) == 128, "forward group");
  CHECK(first_group(flash4::TileOrder::make_bwd<64>(8, 32, 16, 0, 1)) == 32, "backward group");
  CHECK(first_group(flash4::TileOrder::make_bwd<64>(8, 8, 16, 0, 4)) == 128, "backward GQA 4: the forward's");
  CHECK(first_group(flash4::TileOrder::make_bwd<128>(64, 8, 2, 0, 1)) == 2, "backward 8k");
  CHECK(first_group(flash4::TileOrder::make_bwd<256>(64, 8, 2, 0, 1)) == 4, "backward head dim 256: the forward's");
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("%d grids: all checks passed\n", cases);
  return 0;
}
