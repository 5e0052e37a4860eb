// Single-instruction approximations (one MUFU op each) used by the softmax, the softcap and the backward.
// Their errors sit well below the rounding of the 16-bit P and dS that consume them; the library versions
// (exp2f, tanhf, log2f) are multi-instruction sequences without --use_fast_math.
#pragma once

namespace flash4 {

// ex2.approx: 2 ulp; flushes denormal inputs and outputs to zero, which only ever affects P ~ 0.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh.approx: maximum relative error about 2^-11; the capped scores are then rounded far more coarsely by
// the 16-bit P anyway.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// lg2.approx: the sm90 backward recovers tanh(s) of a softcapped score from P instead of keeping it live.
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flash4
