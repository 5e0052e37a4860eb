// Register-fragment helpers shared by both kernel families (arch-independent).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <cstdint>
#include <type_traits>

namespace flash4 {

using namespace cute;

// Converts an fp32 fragment into a 16-bit fragment of the same size, element by element in storage
// order (pairs convert with one cvt.rn.{bf16x2,f16x2}.f32). dst may be a different view of the data.
template <class TensorSrc, class TensorDst>
CUTE_DEVICE void convert_fragment(TensorSrc const& src, TensorDst&& dst) {
  using From = typename std::remove_reference_t<TensorSrc>::value_type;
  using To = typename std::remove_reference_t<TensorDst>::value_type;
  constexpr int kN = decltype(size(src))::value;
  static_assert(kN % 2 == 0 && kN == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, 2> convert;
  auto src2 = recast<cutlass::Array<From, 2> const>(src);
  auto dst2 = recast<cutlass::Array<To, 2>>(dst);
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) dst2(i) = convert(src2(i));
}

// Writes an fp32 accumulator fragment, times `scale`, as 16-bit pairs: accumulator elements e and e + 1 hold
// adjacent columns of one row in both the WGMMA and the mma.sync layouts. coord: the fragment's (row, col)
// inside the tile; out: the tile's (0, 0) in global memory; rows >= row_limit are skipped.
template <class Element, class Acc, class Coord>
CUTE_DEVICE void store_pairs(Acc const& acc, Coord const& coord, Element* out, int64_t row_stride, int row_limit,
                             float scale) {
#pragma unroll
  for (int e = 0; e < size(acc); e += 2) {
    const int row = get<0>(coord(e));
    if (row < row_limit) {
      cutlass::Array<float, 2> f;
      f[0] = acc(e) * scale;
      f[1] = acc(e + 1) * scale;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(out + row * row_stride + get<1>(coord(e))) =
          cutlass::NumericArrayConverter<Element, float, 2>{}(f);
    }
  }
}

}  // namespace flash4
