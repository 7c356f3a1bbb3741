#include "core/dtype.h"

#include "core/status.h"

#include <cstring>

namespace xinfer {

size_t dtype_size(DType dtype) {
    switch (dtype) {
        case DType::f32: return 4;
        case DType::f16: return 2;
        case DType::bf16: return 2;
        case DType::f8_e4m3: return 1;
        case DType::e8m0: return 1;
        case DType::fp4_e2m1: return 1;
        case DType::i32: return 4;
        case DType::i64: return 8;
        case DType::u8: return 1;
    }
    return 0;
}

size_t dtype_row_bytes(DType dtype, int64_t n) {
    if (dtype == DType::fp4_e2m1) return size_t((n + 1) / 2);
    return dtype_size(dtype) * size_t(n);
}

std::string_view dtype_name(DType dtype) {
    switch (dtype) {
        case DType::f32: return "f32";
        case DType::f16: return "f16";
        case DType::bf16: return "bf16";
        case DType::f8_e4m3: return "f8_e4m3";
        case DType::e8m0: return "e8m0";
        case DType::fp4_e2m1: return "fp4_e2m1";
        case DType::i32: return "i32";
        case DType::i64: return "i64";
        case DType::u8: return "u8";
    }
    return "?";
}

std::optional<DType> dtype_from_safetensors(std::string_view name) {
    if (name == "F32") return DType::f32;
    if (name == "F16") return DType::f16;
    if (name == "BF16") return DType::bf16;
    if (name == "F8_E4M3") return DType::f8_e4m3;
    if (name == "F8_E8M0") return DType::e8m0;
    if (name == "I32") return DType::i32;
    if (name == "I64") return DType::i64;
    if (name == "U8") return DType::u8;
    return std::nullopt;
}

float f16_to_f32(uint16_t bits) {
    const uint32_t sign = uint32_t(bits & 0x8000u) << 16;
    uint32_t exponent = (bits >> 10) & 0x1fu;
    uint32_t mantissa = bits & 0x3ffu;
    if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        if (mantissa == 0) return std::bit_cast<float>(sign);
        // Subnormal: value = mantissa * 2^-24.
        const float magnitude = std::ldexp(float(mantissa), -24);
        return sign ? -magnitude : magnitude;
    }
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t f32_to_f16(float value) {
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
    const float magnitude = std::fabs(value);
    if (std::isnan(value)) return uint16_t(sign | 0x7e00u);
    if (magnitude >= 65520.0f) return uint16_t(sign | 0x7c00u);
    if (magnitude < 6.103515625e-05f) {  // subnormal range: quantum 2^-24
        const uint16_t mantissa = uint16_t(std::nearbyint(magnitude * 16777216.0f));
        return uint16_t(sign | mantissa);
    }
    uint32_t rounded = (bits & 0x7fffffffu) + 0xfffu + ((bits >> 13) & 1u);
    return uint16_t(sign | ((rounded - (112u << 23)) >> 13));
}

float f8_e4m3_to_f32(uint8_t bits) {
    const bool negative = bits & 0x80u;
    const int exponent = (bits >> 3) & 0xf;
    const int mantissa = bits & 0x7;
    float magnitude;
    if (exponent == 0xf && mantissa == 0x7) {
        magnitude = NAN;
    } else if (exponent == 0) {
        magnitude = std::ldexp(float(mantissa), -9);  // subnormal: m/8 * 2^-6
    } else {
        magnitude = std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
    }
    return negative ? -magnitude : magnitude;
}

uint8_t f32_to_f8_e4m3(float value) {
    if (std::isnan(value)) return 0x7f;
    const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
    float magnitude = std::fmin(std::fabs(value), 448.0f);
    // Exhaustive nearest search over the 127 non-negative finite codes keeps this obviously
    // correct; it is used only by tests and offline quantization, never on a hot path.
    uint8_t best = 0;
    float best_error = INFINITY;
    for (uint8_t code = 0; code < 0x7f; ++code) {
        const float error = std::fabs(f8_e4m3_to_f32(code) - magnitude);
        if (error < best_error || (error == best_error && (code & 1) == 0)) {
            best = code;
            best_error = error;
        }
    }
    return uint8_t(sign | best);
}

void convert_to_f32(DType src_dtype, const void* src, float* dst, int64_t n) {
    switch (src_dtype) {
        case DType::f32: std::memcpy(dst, src, size_t(n) * 4); return;
        case DType::bf16: {
            const auto* in = static_cast<const uint16_t*>(src);
            for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(in[i]);
            return;
        }
        case DType::f16: {
            const auto* in = static_cast<const uint16_t*>(src);
            for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(in[i]);
            return;
        }
        case DType::f8_e4m3: {
            const auto* in = static_cast<const uint8_t*>(src);
            for (int64_t i = 0; i < n; ++i) dst[i] = f8_e4m3_to_f32(in[i]);
            return;
        }
        case DType::e8m0: {
            const auto* in = static_cast<const uint8_t*>(src);
            for (int64_t i = 0; i < n; ++i) dst[i] = e8m0_to_f32(in[i]);
            return;
        }
        default: fail("convert_to_f32: unsupported source dtype {}", dtype_name(src_dtype));
    }
}

void convert_from_f32(const float* src, DType dst_dtype, void* dst, int64_t n) {
    switch (dst_dtype) {
        case DType::f32: std::memcpy(dst, src, size_t(n) * 4); return;
        case DType::bf16: {
            auto* out = static_cast<uint16_t*>(dst);
            for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(src[i]);
            return;
        }
        case DType::f16: {
            auto* out = static_cast<uint16_t*>(dst);
            for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(src[i]);
            return;
        }
        default: fail("convert_from_f32: unsupported destination dtype {}", dtype_name(dst_dtype));
    }
}

}  // namespace xinfer
