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

template <class Traits, bool kCausal, bool kLocal, bool kEven, class Iter, class AccumPV>
void launch_fwd_sm80_cap(const FwdParams& p, cudaStream_t stream) {
  // Softcap is its own kernel, chosen here so the dispatch table stays per mask (as on sm90).
  if (p.softcap > 0.f) {
    using Kernel = FwdKernelSm80<Traits, kCausal, kLocal, true, kEven, Iter, AccumPV>;
    launch_kernel<Kernel>(kernel_entry_sm80<Kernel>, p, stream, "sm80 forward kernel launch (softcap)");
  } else {
    using Kernel = FwdKernelSm80<Traits, kCausal, kLocal, false, kEven, Iter, AccumPV>;
    launch_kernel<Kernel>(kernel_entry_sm80<Kernel>, p, stream, "sm80 forward kernel launch");
  }
}

// P V's accumulation: fp16 when asked for and the inputs are float16 (the binding sets accum_pv_fp16 only then),
// up to head dim 128 and without a window or block mask: above 128 O alone takes 128 registers a thread and
// the fp16 variant spilled 20-32 B; the window variant spilled 8 B at 128 (ptxas, sm_80). Those keep fp32.
template <class Traits, bool kCausal, bool kLocal, bool kEven, class Iter>
void launch_fwd_sm80_accum(const FwdParams& p, cudaStream_t stream) {
  if constexpr (std::is_same_v<typename Traits::Element, cutlass::half_t> && Traits::kHeadDim <= 128 && !kLocal &&
                !kIsSparse<Iter>) {
    if (p.accum_pv_fp16) {
      launch_fwd_sm80_cap<Traits, kCausal, kLocal, kEven, Iter, AccumPVF16>(p, stream);
      return;
    }
  }
  launch_fwd_sm80_cap<Traits, kCausal, kLocal, kEven, Iter, AccumPVF32>(p, stream);
}

template <DType kDType, int kHeadDim, bool kSmall>
using FwdTraitsSm80Of =
    FwdTraitsSm80<CutlassElement<kDType>, kHeadDim, fwd_tile_sm80(kHeadDim, kSmall).block_m,
                  fwd_tile_sm80(kHeadDim, kSmall).block_n, fwd_tile_sm80(kHeadDim, kSmall).warps>;

template <class Traits, bool kCausal, bool kLocal, class Iter>
void run_fwd_sm80_tile(const FwdParams& p, cudaStream_t stream) {
  require_smem(p, Traits::kSmemBytes, "sm80 forward kernel");
  // Lengths that are multiples of the tile (fixed-length batches) take the kernel without row predicates and
  // key-end mask code: hdim 64 non-causal +8%, hdim 128 +3-5% (H200, forced sm80 path).
  if (tiles_even(p, Traits::kBlockM, Traits::kBlockN)) {
    launch_fwd_sm80_accum<Traits, kCausal, kLocal, true, Iter>(p, stream);
  } else {
    launch_fwd_sm80_accum<Traits, kCausal, kLocal, false, Iter>(p, stream);
  }
}

// The table's tile where the device's shared memory holds it, else the 99 KB row (tile_size.h).
template <DType kDType, int kHeadDim, bool kCausal, bool kLocal, class Iter = DenseBand>
void run_fwd_sm80(const FwdParams& p, cudaStream_t stream) {
  using Large = FwdTraitsSm80Of<kDType, kHeadDim, false>;
  using Small = FwdTraitsSm80Of<kDType, kHeadDim, true>;
  if constexpr (std::is_same_v<Large, Small>) {
    run_fwd_sm80_tile<Large, kCausal, kLocal, Iter>(p, stream);
  } else if (smem_fits(p, Large::kSmemBytes)) {
    run_fwd_sm80_tile<Large, kCausal, kLocal, Iter>(p, stream);
  } else {
    run_fwd_sm80_tile<Small, kCausal, kLocal, Iter>(p, stream);
  }
}

}  // namespace flash4
