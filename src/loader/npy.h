// NumPy .npy files of float32 (format 1.0, '<f4', C order): the exchange format for reference
// activations produced by the Python fixture scripts and for tensors dumped by tools.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

namespace xinfer {

struct NpyArray {
    std::vector<int64_t> shape;  // empty for a 0-d array
    std::vector<float> data;     // row-major, numel elements
};

// Writes numel(shape) floats from `data`. The header is padded so the data starts at a multiple
// of 64 bytes, as NumPy itself does. Throws Error naming the file on failure.
void write_npy_f32(const std::filesystem::path& path, const float* data, std::vector<int64_t> shape);

// Reads a little-endian float32, C-order .npy (versions 1.0–3.0 of the header). Any other
// dtype, Fortran order or a truncated file is an Error naming the file and what was found.
NpyArray read_npy_f32(const std::filesystem::path& path);

}  // namespace xinfer
