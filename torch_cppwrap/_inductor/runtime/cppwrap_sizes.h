// What size and index expressions printed by Inductor's C++ printer call:
// std:: math, three helpers it spells `c10::`, and `align`.  The helpers live in
// c10/util/generic_math.h, which pulls in Half and BFloat16 and costs the
// wrapper about a second of parsing, so the wrapper gets lean equivalents.
// Kernels compile in their own translation unit with the real header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace cppwrap {

// An index into a dimension of `size` elements, held within [0, size].
inline int64_t clamp_index(int64_t index, int64_t size) {
  return std::max<int64_t>(0, std::min<int64_t>(size, index));
}

}  // namespace cppwrap

// sympy's align() in config.memory_planning's pool sizes and offsets,
// printed unqualified: `nbytes` rounded up to a multiple of 64 bytes
// (torch._inductor.utils.ALIGN_BYTES).
[[maybe_unused]] inline int64_t align(int64_t nbytes) {
  return (nbytes + 63) & -64;
}

namespace c10 {

// Python's floor division on integers; 0 for a zero divisor, as c10's.
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline T div_floor_integer(T a, T b) {
  if (b == 0) {
    return T(0);
  }
  if (std::is_signed_v<T> && a == std::numeric_limits<T>::min() && b == T(-1)) {
    return a;
  }
  T quotient = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) {
    --quotient;
  }
  return quotient;
}

// Python's floor division on floating point values: (a - fmod(a, b)) / b
// is a whole number, one too large when the remainder's sign is not b's.
inline double div_floor_floating(double a, double b) {
  if (b == 0) {
    return a / b;
  }
  double rem = std::fmod(a, b);
  double quotient = std::round((a - rem) / b);
  if (rem != 0 && ((rem < 0) != (b < 0))) {
    quotient -= 1.0;
  }
  return quotient == 0 ? std::copysign(0.0, a / b) : quotient;
}

// Python's modulo: the result takes the divisor's sign.
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline T div_mod(T a, T b) {
  T mod = a % b;
  if (mod != 0 && ((b < 0) != (mod < 0))) {
    mod += b;
  }
  return mod;
}

template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline T div_mod(T a, T b) {
  T mod = std::fmod(a, b);
  if (mod != 0 && ((b < 0) != (mod < 0))) {
    mod += b;
  }
  return mod;
}

}  // namespace c10
