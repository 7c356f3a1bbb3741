// Writes a safetensors file: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the tensors' bytes back to back. Used by tests to
// build tiny checkpoints and by tools that dump activations.
#pragma once

#include "core/dtype.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace xinfer {

struct SafetensorsEntry {
    std::string name;
    DType dtype = DType::f32;    // any dtype with a safetensors name (not fp4_e2m1: store packed fp4 as u8)
    std::vector<int64_t> shape;  // empty for a scalar
    const void* data = nullptr;  // numel × dtype_size bytes, borrowed for the duration of the call
};

// safetensors' name for a dtype ("F32", "BF16", ...); throws for dtypes the format lacks.
std::string safetensors_dtype_name(DType dtype);

// Writes `tensors` to `path` (replacing it). The data section holds no gaps and tensors are
// ordered by decreasing element size, then name, so every tensor starts aligned to its element
// size (the header is padded with spaces to a multiple of 8, as the format allows). `metadata`,
// when not null, becomes "__metadata__" and must be an object of strings.
// Throws Error naming the file or tensor on a bad entry or an I/O failure.
void write_safetensors(const std::filesystem::path& path, const std::vector<SafetensorsEntry>& tensors,
                       const nlohmann::json& metadata = {});

}  // namespace xinfer
