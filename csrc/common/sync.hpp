// Counters that order work between CTAs (deterministic dQ): a gpu-scope acquire load and release increment
// (sm70 and later, so both kernel families use them); fire-and-forget fp32 reductions; and the two halves of
// programmatic dependent launch.
#pragma once

#include <cute/config.hpp>

namespace flash4 {

CUTE_DEVICE int load_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

CUTE_DEVICE void release_increment_gpu(int* p) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(p) : "memory");
}

// An atomicAdd whose result is unused should compile to a reduction (REDG), but inside the sm90 wide backward
// and the sm80 backward ptxas emitted value-returning ATOMG: each holds its destination registers until L2
// answers, and the warp stalls when it needs them. The explicit forms cannot return anything.
CUTE_DEVICE void red_add_f32(float* p, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

CUTE_DEVICE void red_add_f32x4(float4* p, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

// Programmatic dependent launch (sm90): a kernel launched with the programmatic-serialization attribute
// (launch_common.hpp) is scheduled before the previous kernel in the stream has finished, so its launch
// latency hides behind that kernel's tail. It must wait_prior_grid() before touching global memory: the wait
// returns once the previous grid has completed and its writes are visible. allow_dependent_grid() lets the
// next such kernel be scheduled as soon as every CTA of this grid has called it (or exited). Both are no-ops
// for kernels launched without the attribute and on sm80.
CUTE_DEVICE void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

CUTE_DEVICE void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace flash4
