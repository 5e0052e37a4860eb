// fp8 (e4m3) pieces of the sm90 forward: P from the S accumulator into the A operand of the fp8 P V WGMMA,
// and the key order of V^T that makes that a conversion with no register shuffles.
//
// 8-bit WGMMA takes A from registers in a layout unlike the fp32 accumulator's (m64nNk32, per thread t of a
// quad, lane / 4 = row r):
//   S accumulator: row r and r + 8, keys 8 i + 2 t + {0, 1} for each 8-key chunk i;
//   A operand (per 32 keys): row r, k = 4 t + {0..3} and 16 + 4 t + {0..3}; the same for row r + 8.
// A thread holds 8 scores of each row per 32 keys in both, just not the same keys. Rather than move values
// between lanes (FA3 shuffles bytes), the kernel hands its own scores over in place and V^T is stored with
// its keys permuted within every 32, so that A's position k meets the key whose score went there:
//   position k = 16 h + 4 t + 2 i + e  holds key  16 h + 8 i + 2 t + e   (h, i, e in {0, 1}, t in 0..3),
// i.e. the key digits (h, i, t, e) of sizes (2, 2, 4, 2) become (h, t, i, e): one axis permutation, done by
// the pre-pass that transposes V (csrc/fp8_vt.cu). The mask still sees keys in order.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace flash4 {

using namespace cute;

// P (fp32 accumulator of S, ((2, 2, N/8), 1, 1) per thread) -> the fp8 A fragment ((4, 2, 2), 1, N/32) of
// the P V GEMM. Within each 32 keys (16 accumulator values a, 16 A values in 4 registers):
//   A register 0 (row r,     k 4t..4t+3)  <- a0 a1 a4 a5     register 2 (row r,     k 16+4t..)  <- a8 a9 a12 a13
//   A register 1 (row r + 8, k 4t..4t+3)  <- a2 a3 a6 a7     register 3 (row r + 8, k 16+4t..)  <- a10 a11 a14 a15
// so the 8-value halves swap their middle pairs; satfinite conversion, 4 values per register.
template <class TensorS, class TensorP>
CUTE_DEVICE void pack_p_fp8(TensorS const& s, TensorP& p) {
  using To = typename std::remove_reference_t<TensorP>::value_type;
  constexpr int kN = decltype(size(s))::value;
  static_assert(kN % 16 == 0 && kN == decltype(size(p))::value);
  cutlass::NumericArrayConverter<To, float, 4, cutlass::FloatRoundStyle::round_to_nearest> convert;
  static_assert(decltype(cosize(p.layout()))::value == kN, "P's fragment must be compact");
  // The fragment's storage order is its value order (((4, 2, 2), 1, N/32) with strides ((1, 4, 8), 0, 16)).
  auto p4 = recast<cutlass::Array<To, 4>>(make_tensor(p.data(), make_layout(Int<kN>{})));
#pragma unroll
  for (int i = 0; i < kN / 8; ++i) {
    cutlass::Array<float, 4> lo, hi;
    lo[0] = s(8 * i + 0), lo[1] = s(8 * i + 1), lo[2] = s(8 * i + 4), lo[3] = s(8 * i + 5);
    hi[0] = s(8 * i + 2), hi[1] = s(8 * i + 3), hi[2] = s(8 * i + 6), hi[3] = s(8 * i + 7);
    p4(2 * i) = convert(lo);
    p4(2 * i + 1) = convert(hi);
  }
}

}  // namespace flash4
