// Host-side check of common/dropout.hpp (compiled with nvcc and run by tests/test_dropout.py): the keep bits
// each thread of the sm90 kernels computes, walked through the real accumulator partitions (the forward's
// S = Q K^T and the backward's S^T = K Q^T at head dim 128), printed as one query x key mask per layout for
// the Python side to compare with flash_attn4.dropout.keep_mask. Arguments: seed offset threshold bidb
// nheads bidh row0 col0.
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include <cutlass/numeric_types.h>

#include "common/dropout.hpp"
#include "sm90/kernel_traits_bwd_sm90.hpp"
#include "sm90/kernel_traits_fwd_sm90.hpp"
#include "sm90/utils_sm90.hpp"

using namespace cute;

// The kernels' lanes trade words with lane ^ 4 (ShflXor4). What a lane sends depends only on its own Philox
// calls, so two passes emulate the shuffle exactly: the first records every thread's sends, the second hands
// each thread its partner's, in order.
template <bool kRowsAreQueries, class TiledMma, class TileShape>
std::vector<int> mask_of(flash4::Dropout const& d, uint32_t threshold, int threads, int q0, int k0) {
  constexpr int kRows = decltype(size<0>(TileShape{}))::value, kCols = decltype(size<1>(TileShape{}))::value;
  std::vector<int> mask(kRows * kCols, -1);
  TiledMma mma;
  auto rowcol = [](auto t) { return make_tensor(t.data(), flash4::acc_rowcol_layout(t.layout())); };
  Tensor tC0 = rowcol(mma.get_thread_slice(0).partition_C(make_identity_tensor(TileShape{})));
  const int row0 = kRowsAreQueries ? q0 : k0, col0 = kRowsAreQueries ? k0 : q0;
  std::vector<std::vector<uint32_t>> sent(threads);
  for (int pass = 0; pass < 2; ++pass) {
    for (int t = 0; t < threads; ++t) {
      Tensor tC = rowcol(mma.get_thread_slice(t).partition_C(make_identity_tensor(TileShape{})));
      size_t n = 0;
      auto swap = [&](uint32_t v) -> uint32_t {
        if (pass == 0) {
          sent[t].push_back(v);
          return 0u;
        }
        return sent[t ^ 4].at(n++);
      };
      d.for_each_keep<kRowsAreQueries>(
          tC, tC0, row0, col0, threshold,
          [&](int r, int c, bool kept) {
            if (pass == 0) return;
            const int row = get<0>(tC(r, c)), col = get<1>(tC(r, c));
            const int q = kRowsAreQueries ? row : col, k = kRowsAreQueries ? col : row;
            mask[q * (kRowsAreQueries ? kCols : kRows) + k] = kept;
          },
          swap);
      if (pass == 1 && n != sent[t ^ 4].size()) std::abort();  // the pair's lanes swap in step
    }
  }
  return mask;
}

int main(int argc, char** argv) {
  if (argc != 9) return 2;
  const int64_t rng[2] = {std::atoll(argv[1]), std::atoll(argv[2])};
  const uint32_t threshold = uint32_t(std::atoll(argv[3]));
  const int bidb = std::atoi(argv[4]), nheads = std::atoi(argv[5]), bidh = std::atoi(argv[6]);
  const int q0 = std::atoi(argv[7]), k0 = std::atoi(argv[8]);
  flash4::DropoutParams params;
  params.rng = rng;
  const flash4::Dropout d = flash4::Dropout::make(params, bidb, nheads, bidh).with_stream(params);

  // The causal forward's 128-key tile (eight 16-column blocks: all paired), the non-causal one's 176 keys
  // (eleven: the last one unpaired) and the backward's S^T.
  using Fwd = flash4::FwdTraitsSm90<cutlass::bfloat16_t, 128, 128, 128, 2>;
  using Fwd176 = flash4::FwdTraitsSm90<cutlass::bfloat16_t, 128, 128, 176, 2>;
  using Bwd = flash4::BwdTraitsSm90<cutlass::bfloat16_t, 128, 64, 128, 2>;
  using TileS = Shape<Int<Bwd::kBlockN>, Int<Bwd::kBlockM>>;  // (keys, queries)
  const auto fwd = mask_of<true, Fwd::TiledMmaQK, decltype(select<0, 1>(Fwd::TileShapeQK{}))>(
      d, threshold, 2 * 128, q0, k0);
  const auto fwd176 = mask_of<true, Fwd176::TiledMmaQK, decltype(select<0, 1>(Fwd176::TileShapeQK{}))>(
      d, threshold, 2 * 128, q0, k0);
  const auto bwd = mask_of<false, Bwd::TiledMmaSdP, TileS>(d, threshold, 2 * 128, q0, k0);
  // Query-major masks: forward 128 queries x 128 and x 176 keys; backward 64 queries x 128 keys.
  for (auto const& [name, mask] : {std::pair{"fwd", fwd}, std::pair{"fwd176", fwd176}, std::pair{"bwd", bwd}}) {
    std::printf("%s\n", name);
    for (int x : mask) std::printf("%d", x);
    std::printf("\n");
  }
  return 0;
}
