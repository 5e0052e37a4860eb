// The __global__ entry shared by the sm90 kernels: a Kernel class (operator()(Params, smem)) launched with
// its Params as a __grid_constant__ argument, so TMA descriptors are read in place from parameter memory.
#pragma once

#include <cute/config.hpp>

namespace flash4 {

// __launch_bounds__(threads, 1): one CTA per SM, and the register cap at entry that setmaxnreg needs.
template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    kernel_entry_sm90(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
// The body exists only in the sm_90a pass: wgmma, setmaxnreg and TMA multicast are sm_90a features, and a
// build that also targets consumer GPUs (sm_120 has no wgmma) compiles this file for them too.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  extern __shared__ char smem[];
  Kernel{}(params, smem);
#endif
}

}  // namespace flash4
