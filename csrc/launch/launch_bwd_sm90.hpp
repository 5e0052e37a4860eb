// Host side of the sm90 backward: pre-pass, main kernel, post-pass, all on `stream`. Included once per
// generated backward instantiation .cu.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "../common/bwd_prepost.cuh"
#include "../sm90/kernel_bwd_sm90.hpp"
#include "../sm90/kernel_traits_bwd_sm90.hpp"
#include "launch_fwd_sm90.hpp"  // CutlassElement, check_cuda

namespace flash4 {

template <DType kDType, int kHeadDim, bool kCausal>
void run_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  using Element = CutlassElement<kDType>;
  using Traits = BwdTraitsSm90<Element, kHeadDim, /*stages=*/2>;
  using Kernel = BwdKernelSm90<Traits, kCausal>;
  if (p.seqlen_q_rounded % Traits::kBlockM != 0) {
    throw std::runtime_error("flash_attn4: seqlen_q_rounded must be a multiple of the backward's kBlockM");
  }
  bwd_preprocess_kernel<Element><<<prepost_grid(p), kPrePostThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "backward pre-pass launch");

  auto kernel = bwd_kernel_sm90<Kernel>;
  static std::atomic<uint64_t> attr_set_on_device{0};  // see launch_fwd_sm90.hpp
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(attr_set_on_device.load(std::memory_order_relaxed) & bit)) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes),
               "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    attr_set_on_device.fetch_or(bit, std::memory_order_relaxed);
  }
  const typename Kernel::Params params = Kernel::to_params(p);
  kernel<<<Kernel::grid(p), Kernel::kNumThreads, Kernel::kSmemBytes, stream>>>(params);
  check_cuda(cudaGetLastError(), "backward kernel launch");

  bwd_postprocess_kernel<Element><<<prepost_grid(p), kPrePostThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "backward post-pass launch");
}

}  // namespace flash4
