// Counters that order work between CTAs (deterministic dQ): a gpu-scope acquire load and release increment
// (sm70 and later, so both kernel families use them).
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

}  // namespace flash4
