// Host side of the sm90 forward: picks the tile for (head dim, causal) and launches. Included once per
// generated instantiation .cu.
#pragma once

#include "../common/tile_size.h"
#include "../dispatch.h"
#include "../sm90/kernel_fwd_sm90.hpp"
#include "../sm90/kernel_traits_fwd_sm90.hpp"
#include "launch_common.hpp"

namespace flash4 {

template <DType kDType, int kHeadDim, bool kCausal, bool kLocal>
void run_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  // Windows mask on both sides: they take the causal tiles (smaller kBlockN, fewer registers for masks).
  constexpr FwdTileSm90 tile = fwd_tile_sm90(kHeadDim, kCausal || kLocal);
  using Traits = FwdTraitsSm90<CutlassElement<kDType>, kHeadDim, tile.block_m, tile.block_n, tile.stages>;
  // Softcap is its own kernel (see MainloopFwdSm90), chosen here so the dispatch table stays per mask.
  if (p.softcap > 0.f) {
    launch_sm90<FwdKernelSm90<Traits, kCausal, kLocal, true>>(p, stream, "forward kernel launch (softcap)");
  } else {
    launch_sm90<FwdKernelSm90<Traits, kCausal, kLocal, false>>(p, stream, "forward kernel launch");
  }
}

}  // namespace flash4
