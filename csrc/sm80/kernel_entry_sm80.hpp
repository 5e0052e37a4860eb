// The __global__ entry of the sm80 kernels: a Kernel class (operator()(Params, smem)) launched with its
// plain Params by value.
#pragma once

#include <cute/config.hpp>

namespace flash4 {

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads) kernel_entry_sm80(typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // 128-byte aligned: the swizzled tiles are bank-conflict free relative to a 128-byte boundary.
  extern __shared__ __align__(128) char smem[];
  Kernel{}(params, smem);
#endif
}

}  // namespace flash4
