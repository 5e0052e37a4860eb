// Host side of the sm80 backward: pre-pass, main kernel, post-pass, all on `stream`. Included once per
// generated sm80 backward instantiation .cu.
#pragma once

#include "../common/bwd_prepost.cuh"
#include "../common/tile_size.h"
#include "../dispatch.h"
#include "../sm80/bwd_postprocess_sm80.hpp"
#include "../sm80/kernel_bwd_sm80.hpp"
#include "../sm80/kernel_entry_sm80.hpp"
#include "../sm80/kernel_traits_bwd_sm80.hpp"
#include "launch_common.hpp"

namespace flash4 {

// The traits of the tile bwd_tile_sm80 picks. (A local constexpr tile used as template arguments here, as the
// forward's launcher does, crashes g++ 12 once the generic lambda below refers to the alias.)
template <class Element, int kHeadDim, bool kSmall>
using BwdTraitsSm80Of =
    BwdTraitsSm80<Element, kHeadDim, bwd_tile_sm80(kHeadDim, kSmall).block_m, bwd_tile_sm80(kHeadDim, kSmall).block_n,
                  bwd_tile_sm80(kHeadDim, kSmall).warps, bwd_tile_sm80(kHeadDim, kSmall).stages>;

template <class Traits, bool kCausal, bool kLocal, class Iter>
void run_bwd_sm80_tile(const BwdParams& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  require_smem(p, BwdKernelSm80<Traits, kCausal, kLocal, false, false, Iter>::kSmemBytes, "sm80 backward kernel");
  bwd_preprocess_kernel<Element, kHeadDim><<<prepost_grid<kHeadDim>(p), kPrePostThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "sm80 backward pre-pass launch");
  // Softcap is a kernel of its own (as in the forward), and lengths that are multiples of the tile
  // (fixed-length batches) take the kernel without row predicates.
  const bool even = tiles_even(p, Traits::kBlockM, Traits::kBlockN);
  auto launch = [&](auto softcap, auto even_c) {
    using Kernel = BwdKernelSm80<Traits, kCausal, kLocal, decltype(softcap)::value, decltype(even_c)::value, Iter>;
    launch_kernel<Kernel>(kernel_entry_sm80<Kernel>, p, stream, "sm80 backward kernel launch");
  };
  if (p.softcap > 0.f) {
    even ? launch(cute::true_type{}, cute::true_type{}) : launch(cute::true_type{}, cute::false_type{});
  } else {
    even ? launch(cute::false_type{}, cute::true_type{}) : launch(cute::false_type{}, cute::false_type{});
  }
  const dim3 post_grid(p.seqlen_q_rounded / Traits::kBlockM, p.nheads_q, p.batch);
  bwd_postprocess_sm80_kernel<Traits><<<post_grid, Traits::kNumThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "sm80 backward post-pass launch");
}

// The table's tile where the device's shared memory holds it, else the 99 KB row (tile_size.h).
template <DType kDType, int kHeadDim, bool kCausal, bool kLocal, class Iter = DenseBand>
void run_bwd_sm80(const BwdParams& p, cudaStream_t stream) {
  using Large = BwdTraitsSm80Of<CutlassElement<kDType>, kHeadDim, false>;
  using Small = BwdTraitsSm80Of<CutlassElement<kDType>, kHeadDim, true>;
  if constexpr (std::is_same_v<Large, Small>) {
    run_bwd_sm80_tile<Large, kCausal, kLocal, Iter>(p, stream);
  } else if (smem_fits(p, BwdKernelSm80<Large, kCausal, kLocal, false, false, Iter>::kSmemBytes)) {
    run_bwd_sm80_tile<Large, kCausal, kLocal, Iter>(p, stream);
  } else {
    run_bwd_sm80_tile<Small, kCausal, kLocal, Iter>(p, stream);
  }
}

}  // namespace flash4
