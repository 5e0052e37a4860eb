// Counters that order work between CTAs (deterministic dQ): a gpu-scope acquire load and release increment
// (sm70 and later, so both kernel families use them); and fire-and-forget fp32 reductions.
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

}  // namespace flash4
