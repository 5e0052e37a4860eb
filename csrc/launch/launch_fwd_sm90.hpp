// Host side of the sm90 forward: picks the tile for (head dim, causal), builds the TMA descriptors and
// launches. Included once per generated instantiation .cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cutlass/numeric_types.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../common/tile_size.h"
#include "../dispatch.h"
#include "../sm90/kernel_fwd_sm90.hpp"
#include "../sm90/kernel_traits_fwd_sm90.hpp"

namespace flash4 {

template <DType kDType>
using CutlassElement = std::conditional_t<kDType == DType::kBF16, cutlass::bfloat16_t, cutlass::half_t>;

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn4: ") + what + ": " + cudaGetErrorString(err));
  }
}

template <DType kDType, int kHeadDim, bool kCausal>
void run_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  constexpr FwdTileSm90 tile = fwd_tile_sm90(kHeadDim, kCausal);
  using Traits = FwdTraitsSm90<CutlassElement<kDType>, kHeadDim, tile.block_m, tile.block_n, tile.stages>;
  using Kernel = FwdKernelSm90<Traits, kCausal>;
  auto kernel = fwd_kernel_sm90<Kernel>;
  // Beyond 48 KB a kernel must opt in to dynamic shared memory. The attribute is sticky but belongs to
  // the current device's context, so it is set once per device (bit d of a mask), not once per process.
  static std::atomic<uint64_t> attr_set_on_device{0};
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
  check_cuda(cudaGetLastError(), "forward kernel launch");
}

}  // namespace flash4
