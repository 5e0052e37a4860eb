// Counters that order work between CTAs (deterministic dQ): a gpu-scope acquire load and release increment
// (sm70 and later, so both kernel families use them); and a fire-and-forget fp32 reduction.
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

// atomicAdd whose result is unused usually compiles to RED too; the explicit form guarantees that no warp
// waits for a returned value.
CUTE_DEVICE void red_add_f32(float* p, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

}  // namespace flash4
