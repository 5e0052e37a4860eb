// Host side of the sm90 backward: pre-pass, main kernel, post-pass, all on `stream`. Included once per
// generated backward instantiation .cu.
#pragma once

#include <stdexcept>
#include <type_traits>

#include "../common/bwd_prepost.cuh"
#include "../dispatch.h"
#include "../sm90/bwd_postprocess_sm90.hpp"
#include "../sm90/kernel_bwd_sm90.hpp"
#include "../sm90/kernel_traits_bwd_sm90.hpp"
#include "launch_common.hpp"

namespace flash4 {

template <DType kDType, int kHeadDim, bool kCausal, bool kLocal>
void run_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  using Element = CutlassElement<kDType>;
  // Head dim <= 128: dK and dV split along keys across the warpgroups; above: along head_dim.
  using Traits = std::conditional_t<(kHeadDim <= 128), BwdTraitsSm90<Element, kHeadDim, /*stages=*/2>,
                                    BwdWideTraitsSm90<Element, kHeadDim, /*stages=*/2>>;
  if (p.seqlen_q_rounded % Traits::kBlockM != 0) {
    throw std::runtime_error("flash_attn4: seqlen_q_rounded must be a multiple of the backward's kBlockM");
  }
  bwd_preprocess_kernel<Element, kHeadDim><<<prepost_grid<kHeadDim>(p), kPrePostThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "backward pre-pass launch");
  launch_sm90<BwdKernelSm90<Traits, kCausal, kLocal>>(p, stream, "backward kernel launch");
  const dim3 post_grid(p.seqlen_q_rounded / Traits::kBlockM, p.nheads_q, p.batch);
  bwd_postprocess_sm90_kernel<Traits><<<post_grid, Traits::kNumMmaThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "backward post-pass launch");
}

}  // namespace flash4
