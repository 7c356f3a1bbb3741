// A Hugging Face checkpoint directory: config.json plus safetensors weights (a single
// model.safetensors, or shards listed by model.safetensors.index.json), mmap'd read-only.
//
// Loading is strict (DESIGN.md decision 5): every header is validated when the directory is
// opened (dtype known, shape × dtype size == byte range, ranges inside the file and not
// overlapping, index entries pointing at tensors that exist), and every read checks the
// expected shape. Errors name the file, the tensor, the expected and the actual values.
// Each tensor must be consumed exactly once by the model (read, or skipped by prefix);
// finish() reports leftovers as "unexpected tensor" errors.
#pragma once

#include "core/dtype.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace xinfer {

struct TensorInfo {
    std::string name;
    std::filesystem::path file;   // the shard holding it
    DType dtype = DType::f32;
    std::vector<int64_t> shape;
    const uint8_t* data = nullptr;  // into the mmap'd file
    size_t nbytes = 0;

    int64_t numel() const;
    std::string shape_string() const;  // "[768, 4096]"
};

// Block-scaled FP8 geometry from config.json's quantization_config (quant_method "fp8").
struct Fp8BlockConfig {
    bool enabled = false;
    int64_t block_rows = 128;   // weight_block_size[0]
    int64_t block_cols = 128;   // weight_block_size[1]
};

class Checkpoint {
public:
    // Opens dir/config.json and the weights. With load_weights=false only the config is read
    // (`xinfer plan`, dummy weights). Throws Error naming the file on any problem.
    static std::unique_ptr<Checkpoint> open(const std::filesystem::path& dir, bool load_weights = true);
    ~Checkpoint();

    const std::filesystem::path& dir() const { return dir_; }
    const nlohmann::json& config() const { return config_; }
    const std::filesystem::path& config_path() const { return config_path_; }
    const Fp8BlockConfig& fp8() const { return fp8_; }

    bool has(std::string_view name) const;
    const TensorInfo& info(std::string_view name) const;  // throws "tensor X not found in <dir>"
    std::vector<std::string> names() const;               // sorted

    // Reads tensor `name` converted to dst_dtype (f32, bf16 or f16) into dst (numel elements),
    // after checking its shape equals expected_shape. F8_E4M3 weights with a companion
    // "<name>_scale_inv" (FP32 block scales) are dequantized: W[r,c] = fp8(W8[r,c]) ·
    // scale[r/br, c/bc]. A scale grid that restarts per row shard (a TP-sharded export; see
    // research/mimo_v2_flash.md §6.4) is detected from its row count and honoured.
    // Marks the tensor (and its scale) as consumed.
    void read(std::string_view name, std::span<const int64_t> expected_shape, DType dst_dtype, void* dst);
    void read(std::string_view name, std::initializer_list<int64_t> expected_shape, DType dst_dtype, void* dst) {
        read(name, std::span<const int64_t>(expected_shape.begin(), expected_shape.size()), dst_dtype, dst);
    }
    // Marks every tensor whose name starts with `prefix` as consumed without reading it
    // (e.g. "model.mtp." when speculation does not ask for the MTP heads). Returns how many.
    size_t skip_prefix(std::string_view prefix);
    // Throws if any tensor was never consumed, listing them (the first few) with their files.
    void finish() const;

    // Total bytes of tensor data per stored dtype (for `xinfer info`).
    std::map<DType, uint64_t> bytes_by_dtype() const;

private:
    Checkpoint() = default;
    struct Impl;
    std::unique_ptr<Impl> impl_;
    std::filesystem::path dir_;
    std::filesystem::path config_path_;
    nlohmann::json config_;
    Fp8BlockConfig fp8_;
};

}  // namespace xinfer
