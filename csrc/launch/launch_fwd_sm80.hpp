// Host side of the sm80 forward: picks the tile for the head dim and launches. Included once per generated
// sm80 instantiation .cu.
#pragma once

#include "../common/tile_size.h"
#include "../dispatch.h"
#include "../sm80/kernel_entry_sm80.hpp"
#include "../sm80/kernel_fwd_sm80.hpp"
#include "../sm80/kernel_traits_fwd_sm80.hpp"
#include "launch_common.hpp"

namespace flash4 {

template <class Traits, bool kCausal, bool kLocal, bool kEven, class Iter>
void launch_fwd_sm80_cap(const FwdParams& p, cudaStream_t stream) {
  // Softcap is its own kernel, chosen here so the dispatch table stays per mask (as on sm90).
  if (p.softcap > 0.f) {
    using Kernel = FwdKernelSm80<Traits, kCausal, kLocal, true, kEven, Iter>;
    launch_kernel<Kernel>(kernel_entry_sm80<Kernel>, p, stream, "sm80 forward kernel launch (softcap)");
  } else {
    using Kernel = FwdKernelSm80<Traits, kCausal, kLocal, false, kEven, Iter>;
    launch_kernel<Kernel>(kernel_entry_sm80<Kernel>, p, stream, "sm80 forward kernel launch");
  }
}

template <DType kDType, int kHeadDim, bool kCausal, bool kLocal, class Iter = DenseBand>
void run_fwd_sm80(const FwdParams& p, cudaStream_t stream) {
  constexpr FwdTileSm80 tile = fwd_tile_sm80(kHeadDim);
  using Traits = FwdTraitsSm80<CutlassElement<kDType>, kHeadDim, tile.block_m, tile.block_n, tile.warps>;
  // Lengths that are multiples of the tile (fixed-length batches) take the kernel without row predicates and
  // key-end mask code: hdim 64 non-causal +8%, hdim 128 +3-5% (H200, forced sm80 path).
  if (tiles_even(p, tile.block_m, tile.block_n)) {
    launch_fwd_sm80_cap<Traits, kCausal, kLocal, true, Iter>(p, stream);
  } else {
    launch_fwd_sm80_cap<Traits, kCausal, kLocal, false, Iter>(p, stream);
  }
}

}  // namespace flash4
