// Host side of the sm90 backward: pre-pass, main kernel, post-pass, all on `stream`. Included once per
// generated backward instantiation .cu.
#pragma once

#include <stdexcept>
#include <type_traits>

#include "../common/bwd_prepost.cuh"
#include "../common/dropout.hpp"
#include "../common/tile_size.h"
#include "../dispatch.h"
#include "../sm90/bwd_postprocess_sm90.hpp"
#include "../sm90/kernel_bwd_persistent_sm90.hpp"
#include "../sm90/kernel_bwd_sm90.hpp"
#include "../sm90/kernel_traits_bwd_sm90.hpp"
#include "launch_common.hpp"

namespace flash4 {

// kHeadDimV: v's, out's and dO's head dim; below kHeadDim only in the MLA instantiations, which take the wide
// kernel (head dim 192).
template <DType kDType, int kHeadDim, bool kCausal, bool kLocal, class Iter = DenseBand, class Bias = NoBias,
          int kHeadDimV = kHeadDim>
void run_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  using Element = CutlassElement<kDType>;
  // Head dim <= 128: dK and dV split along keys across the warpgroups; above (wide): along head_dim.
  constexpr BwdTileSm90 tile = bwd_tile_sm90(kHeadDim, Bias::kDrops);
  static_assert(tile.wide || kHeadDimV == kHeadDim, "MLA head dims take the wide backward");
  using Traits =
      std::conditional_t<tile.wide,
                         BwdWideTraitsSm90<Element, kHeadDim, tile.block_m, tile.block_n, tile.stages, kHeadDimV>,
                         BwdTraitsSm90<Element, kHeadDim, tile.block_m, tile.block_n, tile.stages>>;
  if (p.seqlen_q_rounded % Traits::kBlockM != 0) {
    throw std::runtime_error("flash_attn4: seqlen_q_rounded must be a multiple of the backward's kBlockM");
  }
  // D = rowsum(dO o O) runs over v's head dim.
  bwd_preprocess_kernel<Element, kHeadDimV><<<prepost_grid<kHeadDimV>(p), kPrePostThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "backward pre-pass launch");
  using OneTile = BwdKernelSm90<Traits, kCausal, kLocal, Iter, Bias>;
  // Fixed-length batches at head dims <= 128 take the persistent kernel: sliding windows at most half the
  // sequence (nearly every key tile then costs the same) with the forward's static schedule, causal and
  // unmasked attention with the dynamic one (kernel_bwd_persistent_sm90.hpp). Packed batches, block lists,
  // ALiBi and dropout keep one CTA a tile.
  bool persistent = false;
  if constexpr (!Traits::kWide && !kIsSparse<Iter> && !Bias::kEnabled && !Bias::kDrops) {
    persistent = p.cu_seqlens_q == nullptr && p.seqused_q == nullptr && p.seqused_k == nullptr &&
                 (!kLocal || OneTile::Mainloop::tail_blocks(p) > 0);
    if (persistent) {
      launch_sm90<BwdPersistentKernelSm90<Traits, kCausal, kLocal>>(p, stream, "persistent backward kernel launch");
    }
  }
  if (!persistent) launch_sm90<OneTile>(p, stream, "backward kernel launch");
  const dim3 post_grid(p.seqlen_q_rounded / Traits::kBlockM, p.nheads_q, p.batch);
  bwd_postprocess_sm90_kernel<Traits><<<post_grid, Traits::kNumMmaThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "backward post-pass launch");
}

}  // namespace flash4
