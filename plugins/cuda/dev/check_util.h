// Helpers for cuda-op-check: the plugin handle, device buffers through the ABI, host dtype
// conversions, NaN poisoning, relative-error comparison and result bookkeeping. Host-only C++;
// the plugin is reached through include/xinfer/backend_abi.h alone, as the engine reaches it.
#pragma once

#include "xinfer/backend_abi.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace check {

inline const xinfer_backend_api* api = nullptr;
inline void* ctx = nullptr;

// ---- host dtype conversions --------------------------------------------------------------------

inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint16_t f32_to_f16(float f) {
    _Float16 h = _Float16(f);
    uint16_t u;
    std::memcpy(&u, &h, 2);
    return u;
}
inline float f16_to_f32(uint16_t u) {
    _Float16 h;
    std::memcpy(&h, &u, 2);
    return float(h);
}
inline float fp8_to_f32(uint8_t bits) {
    const bool negative = bits & 0x80u;
    const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
    float m;
    if (exponent == 0xf && mantissa == 0x7) m = NAN;
    else if (exponent == 0) m = std::ldexp(float(mantissa), -9);
    else m = std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
    return negative ? -m : m;
}
inline float round_to(int dtype, float v) {
    if (dtype == XINFER_DTYPE_BF16) return bf16_to_f32(f32_to_bf16(v));
    if (dtype == XINFER_DTYPE_F16) return f16_to_f32(f32_to_f16(v));
    return v;
}
inline std::vector<float> rounded(std::vector<float> v, int dtype) {
    for (float& x : v) x = round_to(dtype, x);
    return v;
}
inline size_t dsize(int dtype) {
    switch (dtype) {
        case XINFER_DTYPE_F32: case XINFER_DTYPE_I32: return 4;
        case XINFER_DTYPE_BF16: case XINFER_DTYPE_F16: return 2;
        default: return 1;
    }
}
inline const char* dname(int dtype) {
    switch (dtype) {
        case XINFER_DTYPE_F32: return "f32";
        case XINFER_DTYPE_BF16: return "bf16";
        case XINFER_DTYPE_F16: return "f16";
        case XINFER_DTYPE_F8_E4M3: return "f8";
        case XINFER_DTYPE_I32: return "i32";
        default: return "?";
    }
}
// Host bytes of `v` in `dtype` (f32/bf16/f16).
inline std::vector<uint8_t> encode(const std::vector<float>& v, int dtype) {
    std::vector<uint8_t> out(v.size() * dsize(dtype));
    for (size_t i = 0; i < v.size(); ++i) {
        if (dtype == XINFER_DTYPE_F32) std::memcpy(&out[i * 4], &v[i], 4);
        else {
            const uint16_t h = dtype == XINFER_DTYPE_BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
            std::memcpy(&out[i * 2], &h, 2);
        }
    }
    return out;
}
inline std::vector<float> decode(const std::vector<uint8_t>& bytes, int dtype) {
    const size_t n = bytes.size() / dsize(dtype);
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i) {
        if (dtype == XINFER_DTYPE_F32) std::memcpy(&out[i], &bytes[i * 4], 4);
        else {
            uint16_t h;
            std::memcpy(&h, &bytes[i * 2], 2);
            out[i] = dtype == XINFER_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
    }
    return out;
}

// ---- device buffers ----------------------------------------------------------------------------

struct Buf {
    void* p = nullptr;
    size_t bytes = 0;
    Buf() = default;
    explicit Buf(size_t n) : bytes(n) {
        if (api->alloc(ctx, std::max<size_t>(n, 1), &p) != XINFER_OK) {
            std::fprintf(stderr, "alloc of %zu bytes failed: %s\n", n, api->last_error(ctx));
            std::exit(2);
        }
    }
    Buf(const Buf&) = delete;
    Buf& operator=(const Buf&) = delete;
    Buf(Buf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
    Buf& operator=(Buf&& o) noexcept {
        std::swap(p, o.p);
        std::swap(bytes, o.bytes);
        return *this;
    }
    ~Buf() {
        if (p) api->free(ctx, p);
    }
};

inline Buf upload_bytes(const void* data, size_t n) {
    Buf b(n);
    api->upload(ctx, b.p, data, n);
    api->synchronize(ctx);  // the host vector may die right after
    return b;
}
inline Buf upload(const std::vector<float>& v, int dtype) {
    const auto bytes = encode(v, dtype);
    return upload_bytes(bytes.data(), bytes.size());
}
inline Buf upload_i32(const std::vector<int32_t>& v) { return upload_bytes(v.data(), v.size() * 4); }
inline Buf upload_u8(const std::vector<uint8_t>& v) { return upload_bytes(v.data(), v.size()); }
// A buffer of n elements filled with NaN (0xff bytes: NaN in f32, bf16 and f16; -1 in i32).
inline Buf poisoned(size_t n, int dtype) {
    std::vector<uint8_t> bytes(n * dsize(dtype), 0xff);
    return upload_bytes(bytes.data(), bytes.size());
}
inline void poison(const Buf& b) {
    std::vector<uint8_t> bytes(b.bytes, 0xff);
    api->upload(ctx, b.p, bytes.data(), bytes.size());
    api->synchronize(ctx);
}
inline std::vector<float> download(const Buf& b, int dtype, size_t n) {
    std::vector<uint8_t> bytes(n * dsize(dtype));
    if (api->download(ctx, bytes.data(), b.p, bytes.size()) != XINFER_OK)
        std::fprintf(stderr, "download failed: %s\n", api->last_error(ctx));
    return decode(bytes, dtype);
}
inline std::vector<int32_t> download_i32(const Buf& b, size_t n) {
    std::vector<int32_t> v(n);
    api->download(ctx, v.data(), b.p, n * 4);
    return v;
}
// Fills a large buffer from a random 32 MiB chunk by device copies (generating GBs on the host
// is slow). The chunk is made once per kind; `seed` only shifts where the copies start.
inline Buf fill_chunks[2];  // released by main before the context goes
inline void fill_random_large(const Buf& b, uint32_t seed, bool fp8) {
    Buf* chunks = fill_chunks;
    const size_t chunk = size_t(32) << 20;
    Buf& src = chunks[fp8 ? 1 : 0];
    if (!src.p) {
        std::vector<uint8_t> bytes(chunk);
        std::mt19937 rng(fp8 ? 17 : 19);
        if (fp8) {
            // e4m3 codes with exponent field 2..9 (magnitudes 2^-5 .. 3.75), never NaN.
            for (auto& x : bytes) x = uint8_t((rng() & 0x80u) | (rng() % 0x40u + 0x10u));
        } else {
            // bf16 with exponent 120..122 (magnitudes 2^-7 .. 2^-4), random sign and mantissa.
            for (size_t i = 0; i + 1 < chunk; i += 2) {
                const uint16_t h = uint16_t((rng() & 0x8000u) | ((120u + rng() % 3u) << 7) | (rng() & 0x7fu));
                std::memcpy(&bytes[i], &h, 2);
            }
        }
        src = upload_bytes(bytes.data(), chunk);
    }
    const size_t shift = (size_t(seed) * 4096) % (chunk / 2);
    for (size_t off = 0; off < b.bytes; off += chunk / 2)
        api->copy(ctx, static_cast<char*>(b.p) + off, static_cast<char*>(src.p) + shift,
                  std::min(chunk / 2, b.bytes - off));
    api->synchronize(ctx);
}

inline xinfer_tensor tensor(const Buf& b, int dtype, std::initializer_list<int64_t> shape) {
    xinfer_tensor t{};
    t.data = b.p;
    t.dtype = dtype;
    t.rank = int32_t(shape.size());
    int i = 0;
    for (int64_t d : shape) t.shape[i++] = d;
    return t;
}
inline xinfer_op make_op(int type, const char* name) {
    xinfer_op op{};
    op.type = type;
    op.layer = -1;
    op.name = name;
    return op;
}

// ---- random data ---------------------------------------------------------------------------------

inline std::vector<float> random_vector(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
}

// ---- results -------------------------------------------------------------------------------------

struct Result {
    std::string name;
    bool pass;
    std::string detail;
};
inline std::vector<Result> results;
inline std::vector<std::string> timings;

inline void record(const std::string& name, bool pass, const std::string& detail) {
    results.push_back({name, pass, detail});
    std::printf("%s  %-58s %s\n", pass ? "PASS" : "FAIL", name.c_str(), detail.c_str());
    std::fflush(stdout);
}

// max|got - ref| / max|ref|; any NaN in got fails (NaN never passes).
inline void compare(const std::string& name, const std::vector<float>& got, const std::vector<double>& ref,
                    double tol) {
    if (got.size() != ref.size()) {
        record(name, false, "size mismatch");
        return;
    }
    double max_diff = 0, max_ref = 0;
    size_t nans = 0, worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i]) || std::isinf(got[i])) {
            ++nans;
            continue;
        }
        const double diff = std::fabs(double(got[i]) - ref[i]);
        if (diff > max_diff) {
            max_diff = diff;
            worst = i;
        }
        max_ref = std::max(max_ref, std::fabs(ref[i]));
    }
    const double err = max_ref > 0 ? max_diff / max_ref : max_diff;
    char buf[256];
    std::snprintf(buf, sizeof buf, "rel_err %.2e (tol %.0e)%s", err, tol,
                  nans ? (" NaN/inf x" + std::to_string(nans)).c_str() : "");
    std::string detail = buf;
    if (err > tol && !got.empty()) {
        std::snprintf(buf, sizeof buf, " worst[%zu] got %g ref %g", worst, double(got[worst]), ref[worst]);
        detail += buf;
    }
    record(name, nans == 0 && err <= tol, detail);
}

// Runs an op, recording a failure (with last_error) if it does not return OK.
inline bool run(const std::string& name, const xinfer_op& op) {
    const int rc = api->run_op(ctx, &op);
    if (rc != XINFER_OK) {
        record(name, false, "run_op returned " + std::to_string(rc) + ": " + api->last_error(ctx));
        return false;
    }
    return true;
}

// Mean milliseconds per call of `body` (enqueues work) over `reps` calls, after 2 warm-ups.
inline double time_ms(const std::function<void()>& body, int reps) {
    body();
    body();
    void *start = nullptr, *end = nullptr;
    api->event_record(ctx, &start);
    for (int i = 0; i < reps; ++i) body();
    api->event_record(ctx, &end);
    float ms = 0;
    api->event_elapsed_ms(ctx, start, end, &ms);
    api->event_destroy(ctx, start);
    api->event_destroy(ctx, end);
    return double(ms) / reps;
}
inline void timing(const std::string& line) {
    timings.push_back(line);
    std::printf("TIME  %s\n", line.c_str());
    std::fflush(stdout);
}

}  // namespace check
