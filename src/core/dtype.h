// Element types and their scalar conversions. Quantized types carry their block geometry here
// (DESIGN.md: "quantized formats carry their block geometry in one place").
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace xinfer {

enum class DType : uint8_t {
    f32,
    f16,
    bf16,
    f8_e4m3,   // OCP E4M3 (fn): max 448, no infinities
    e8m0,      // power-of-two scale: 2^(v-127)
    fp4_e2m1,  // packed two per byte, low nibble first
    i32,
    i64,
    u8,
};

// Bytes per element; fp4_e2m1 is packed two per byte and reports 1 per *pair* (see dtype_row_bytes).
size_t dtype_size(DType dtype);
// Bytes of `n` consecutive elements (handles sub-byte packing).
size_t dtype_row_bytes(DType dtype, int64_t n);
std::string_view dtype_name(DType dtype);
// safetensors dtype strings: "F32", "BF16", "F16", "F8_E4M3", "F8_E8M0", "I32", "I64", "U8".
std::optional<DType> dtype_from_safetensors(std::string_view name);

inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

// Round-to-nearest-even, NaN kept quiet.
inline uint16_t f32_to_bf16(float value) {
    uint32_t bits = std::bit_cast<uint32_t>(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);
float f8_e4m3_to_f32(uint8_t bits);
uint8_t f32_to_f8_e4m3(float value);  // round-to-nearest-even, saturating to ±448
inline float e8m0_to_f32(uint8_t bits) { return std::ldexp(1.0f, int(bits) - 127); }

// Converts `n` elements of `src` (any float dtype above, fp8 without scales) into f32.
void convert_to_f32(DType src_dtype, const void* src, float* dst, int64_t n);
// Converts `n` f32 values into `dst_dtype` (f32, f16 or bf16).
void convert_from_f32(const float* src, DType dst_dtype, void* dst, int64_t n);

}  // namespace xinfer
