// c10::ScalarType, DeviceType, Layout and MemoryFormat codes by name, so
// generated code can spell them without ATen headers.  The runtime extension
// static_asserts each value against c10 when it is built.
#pragma once

#include <stdint.h>

namespace cppwrap {
namespace dtype {
constexpr int32_t kUInt8 = 0;
constexpr int32_t kInt8 = 1;
constexpr int32_t kInt16 = 2;
constexpr int32_t kInt32 = 3;
constexpr int32_t kInt64 = 4;
constexpr int32_t kFloat16 = 5;
constexpr int32_t kFloat32 = 6;
constexpr int32_t kFloat64 = 7;
constexpr int32_t kComplex32 = 8;
constexpr int32_t kComplex64 = 9;
constexpr int32_t kComplex128 = 10;
constexpr int32_t kBool = 11;
constexpr int32_t kBFloat16 = 15;
constexpr int32_t kFloat8_e5m2 = 23;
constexpr int32_t kFloat8_e4m3fn = 24;
constexpr int32_t kFloat8_e5m2fnuz = 25;
constexpr int32_t kFloat8_e4m3fnuz = 26;
constexpr int32_t kUInt16 = 27;
constexpr int32_t kUInt32 = 28;
constexpr int32_t kUInt64 = 29;
}  // namespace dtype

namespace device {
constexpr int32_t kCPU = 0;
constexpr int32_t kCUDA = 1;
constexpr int32_t kMeta = 14;
}  // namespace device

namespace layout {
constexpr int32_t kStrided = 0;
}  // namespace layout

namespace memory_format {
constexpr int32_t kContiguous = 0;
constexpr int32_t kPreserve = 1;
constexpr int32_t kChannelsLast = 2;
constexpr int32_t kChannelsLast3d = 3;
}  // namespace memory_format
}  // namespace cppwrap
