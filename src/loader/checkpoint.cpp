#include "loader/checkpoint.h"

#include "core/status.h"
#include "loader/fp8_block.h"
#include "loader/hf_config.h"
#include "loader/safetensors_file.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

namespace xinfer {

namespace {

constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr size_t kMaxListedLeftovers = 10;

std::string shape_text(std::span<const int64_t> shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

bool is_float_dtype(DType dtype) { return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16; }

nlohmann::json read_json_file(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("{}: cannot open: {}", path.string(), std::strerror(errno));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    try {
        return nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& error) {
        // nlohmann's message carries the line and column of the problem.
        fail("{}: invalid JSON: {}", path.string(), error.what());
    }
}

Fp8BlockConfig parse_fp8_config(const ConfigReader& config) {
    Fp8BlockConfig fp8;
    if (!config.has("quantization_config")) return fp8;
    const ConfigReader quantization = config.object("quantization_config");
    // Other methods (mxfp4, compressed-tensors, ...) are left for the model to accept or refuse;
    // the loader only owns the block-FP8 geometry.
    if (quantization.get_string("quant_method", "") != "fp8") return fp8;
    const std::vector<int64_t> block = quantization.get_int_list("weight_block_size");
    if (block.size() != 2 || block[0] <= 0 || block[1] <= 0) {
        quantization.type_error("weight_block_size", "two positive integers [block_rows, block_cols]");
    }
    fp8.enabled = true;
    fp8.block_rows = block[0];
    fp8.block_cols = block[1];
    return fp8;
}

// Copies `bytes` in a few large pieces on several threads: reading from a fresh mmap is bound by
// page faults, which parallelise well.
void parallel_copy(void* dst, const void* src, size_t bytes) {
    constexpr size_t kChunk = size_t(1) << 22;
    const int64_t chunks = int64_t((bytes + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        const size_t begin = size_t(chunk) * kChunk;
        std::memcpy(static_cast<uint8_t*>(dst) + begin, static_cast<const uint8_t*>(src) + begin,
                    std::min(kChunk, bytes - begin));
    }
}

// Converts n elements between float dtypes (f32, bf16, f16) through f32, in chunks small enough
// for a per-thread staging buffer to stay in cache.
void parallel_convert(DType src_dtype, const uint8_t* src, DType dst_dtype, void* dst, int64_t n) {
    constexpr int64_t kChunk = int64_t(1) << 16;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    const size_t src_size = dtype_size(src_dtype), dst_size = dtype_size(dst_dtype);
    auto* dst_bytes = static_cast<uint8_t*>(dst);
#pragma omp parallel if (chunks > 1)
    {
        std::vector<float> staging;
#pragma omp for schedule(static)
        for (int64_t chunk = 0; chunk < chunks; ++chunk) {
            const int64_t begin = chunk * kChunk, count = std::min(kChunk, n - begin);
            const uint8_t* in = src + size_t(begin) * src_size;
            uint8_t* out = dst_bytes + size_t(begin) * dst_size;
            if (dst_dtype == DType::f32) {
                convert_to_f32(src_dtype, in, reinterpret_cast<float*>(out), count);
            } else if (src_dtype == DType::f32) {
                convert_from_f32(reinterpret_cast<const float*>(in), dst_dtype, out, count);
            } else {
                staging.resize(size_t(kChunk));
                convert_to_f32(src_dtype, in, staging.data(), count);
                convert_from_f32(staging.data(), dst_dtype, out, count);
            }
        }
    }
}

}  // namespace

int64_t TensorInfo::numel() const {
    int64_t n = 1;
    for (int64_t dim : shape) n *= dim;
    return n;
}

std::string TensorInfo::shape_string() const { return shape_text(shape); }

struct Checkpoint::Impl {
    struct Entry {
        const TensorInfo* info = nullptr;  // owned by one of `files`
        bool consumed = false;
    };
    std::vector<std::unique_ptr<SafetensorsFile>> files;
    std::map<std::string, Entry, std::less<>> tensors;
    std::string source;  // what was loaded, for "not found" messages: "model.safetensors"

    void open_single(const std::filesystem::path& path);
    void open_sharded(const std::filesystem::path& dir, const std::filesystem::path& index_path);
    Entry& find(std::string_view name, const std::filesystem::path& dir);
    void read_fp8(const TensorInfo& weight, const Fp8BlockConfig& fp8, DType dst_dtype, void* dst);
};

void Checkpoint::Impl::open_single(const std::filesystem::path& path) {
    files.push_back(SafetensorsFile::open(path));
    for (const TensorInfo& info : files.back()->tensors()) tensors[info.name].info = &info;
    source = kSingleFile;
}

void Checkpoint::Impl::open_sharded(const std::filesystem::path& dir, const std::filesystem::path& index_path) {
    const nlohmann::json index = read_json_file(index_path);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
        fail("{}: expected an object with a \"weight_map\" object mapping tensor names to shard files",
             index_path.string());
    }
    std::map<std::string, std::string> weight_map;  // tensor name → shard file name
    std::map<std::string, std::string> first_tensor_of_shard;
    for (const auto& [name, shard] : index["weight_map"].items()) {
        if (!shard.is_string()) {
            fail("{}: weight_map entry for tensor {}: expected a shard file name, found {}", index_path.string(), name,
                 shard.dump());
        }
        weight_map[name] = shard.get<std::string>();
        first_tensor_of_shard.emplace(shard.get<std::string>(), name);
    }

    for (const auto& [shard, first_tensor] : first_tensor_of_shard) {
        const std::filesystem::path shard_path = dir / shard;
        if (!std::filesystem::exists(shard_path)) {
            fail("{}: tensor {} is mapped to shard {}, which does not exist in {}", index_path.string(), first_tensor,
                 shard, dir.string());
        }
        files.push_back(SafetensorsFile::open(shard_path));
        for (const TensorInfo& info : files.back()->tensors()) {
            const auto listed = weight_map.find(info.name);
            if (listed == weight_map.end()) {
                fail("{}: tensor {} is not listed in {}", shard_path.string(), info.name, index_path.string());
            }
            const auto [existing, inserted] = tensors.try_emplace(info.name, Entry{&info});
            if (!inserted) {
                fail("tensor {} is present in two shards: {} and {}", info.name, existing->second.info->file.string(),
                     shard_path.string());
            }
            if (listed->second != shard) {
                fail("{}: tensor {} is stored here, but {} maps it to {}", shard_path.string(), info.name,
                     index_path.string(), listed->second);
            }
        }
    }
    // Every shard's tensors matched the index above, so an entry not loaded now names a tensor
    // its shard lacks.
    for (const auto& [name, shard] : weight_map) {
        if (!tensors.contains(name)) {
            fail("{}: tensor {} is mapped to {}, which does not contain it", index_path.string(), name,
                 (dir / shard).string());
        }
    }
    source = fmt::format("{} ({} shards)", kIndexFile, files.size());
}

Checkpoint::Impl::Entry& Checkpoint::Impl::find(std::string_view name, const std::filesystem::path& dir) {
    const auto it = tensors.find(name);
    if (it == tensors.end())
        fail("tensor {} not found in {} ({})", name, dir.string(), source.empty() ? "no weights loaded" : source);
    return it->second;
}

void Checkpoint::Impl::read_fp8(const TensorInfo& weight, const Fp8BlockConfig& fp8, DType dst_dtype, void* dst) {
    const std::string file = weight.file.string();
    const std::string scale_name = weight.name + "_scale_inv";
    const auto scale_it = tensors.find(scale_name);
    if (scale_it == tensors.end()) {
        fail("{}: fp8 tensor {} has no {} (block-scaled FP8 needs its scales to be dequantized)", file, weight.name,
             scale_name);
    }
    const TensorInfo& scale = *scale_it->second.info;
    if (scale.dtype != DType::f32) {
        fail("{}: tensor {}: expected dtype F32 for fp8 block scales, found {}", scale.file.string(), scale_name,
             dtype_name(scale.dtype));
    }
    // A 3-D weight is a stack of experts [E, rows, cols] whose scales stack the same way.
    const size_t rank = weight.shape.size();
    const bool stacked = rank == 3 && scale.shape.size() == 3 && scale.shape[0] == weight.shape[0];
    if (!(rank == 2 && scale.shape.size() == 2) && !stacked) {
        fail(
            "{}: fp8 tensor {} {} with scale {} {}: expected a 2-D weight with a 2-D scale, or a 3-D [E, rows, cols] "
            "weight with an [E, scale_rows, scale_cols] scale",
            file, weight.name, weight.shape_string(), scale_name, scale.shape_string());
    }
    const int64_t matrices = stacked ? weight.shape[0] : 1;
    const int64_t rows = weight.shape[rank - 2], cols = weight.shape[rank - 1];
    const int64_t scale_rows = scale.shape[rank - 2], scale_cols = scale.shape[rank - 1];
    const std::optional<Fp8ScaleGrid> grid =
        fit_fp8_scale_grid(rows, cols, fp8.block_rows, fp8.block_cols, scale_rows, scale_cols);
    if (!grid) {
        fail(
            "{}: fp8 tensor {} has {} rows, {} cols but its scale {} has shape {}: with {}x{} blocks expected "
            "[{}, {}], or a row grid restarting at equal row shards",
            file, weight.name, rows, cols, scale_name, scale.shape_string(), fp8.block_rows, fp8.block_cols,
            (rows + fp8.block_rows - 1) / fp8.block_rows, (cols + fp8.block_cols - 1) / fp8.block_cols);
    }
    // Copy the (small) scales out of the mapping so that no f32 is read from an address the
    // file layout might leave unaligned.
    std::vector<float> scales(size_t(scale.numel()));
    std::memcpy(scales.data(), scale.data, scale.nbytes);
    dequantize_fp8_blocks(weight.data, scales.data(), matrices, *grid, dst_dtype, dst);
    scale_it->second.consumed = true;
}

std::unique_ptr<Checkpoint> Checkpoint::open(const std::filesystem::path& dir, bool load_weights) {
    if (!std::filesystem::is_directory(dir)) fail("{}: checkpoint directory does not exist", dir.string());
    std::unique_ptr<Checkpoint> checkpoint(new Checkpoint());
    checkpoint->impl_ = std::make_unique<Impl>();
    checkpoint->dir_ = dir;
    checkpoint->config_path_ = dir / "config.json";
    checkpoint->config_ = read_json_file(checkpoint->config_path_);
    if (!checkpoint->config_.is_object()) {
        fail("{}: expected a JSON object, found {}", checkpoint->config_path_.string(),
             checkpoint->config_.type_name());
    }
    checkpoint->fp8_ = parse_fp8_config(ConfigReader(checkpoint->config_, checkpoint->config_path_));
    if (!load_weights) return checkpoint;

    // Strict on purpose: a directory holding stray *.safetensors (a reference dump, an old
    // export) must not be silently merged into the model.
    if (std::filesystem::exists(dir / kIndexFile)) {
        checkpoint->impl_->open_sharded(dir, dir / kIndexFile);
    } else if (std::filesystem::exists(dir / kSingleFile)) {
        checkpoint->impl_->open_single(dir / kSingleFile);
    } else {
        fail("{}: no weights found: looked for {} and {}", dir.string(), kIndexFile, kSingleFile);
    }
    return checkpoint;
}

Checkpoint::~Checkpoint() = default;

bool Checkpoint::has(std::string_view name) const { return impl_->tensors.contains(name); }

const TensorInfo& Checkpoint::info(std::string_view name) const { return *impl_->find(name, dir_).info; }

std::vector<std::string> Checkpoint::names() const {
    std::vector<std::string> result;
    result.reserve(impl_->tensors.size());
    for (const auto& [name, entry] : impl_->tensors) result.push_back(name);
    return result;
}

void Checkpoint::read(std::string_view name, std::span<const int64_t> expected_shape, DType dst_dtype, void* dst) {
    Impl::Entry& entry = impl_->find(name, dir_);
    const TensorInfo& tensor = *entry.info;
    const std::string file = tensor.file.string();
    if (!std::equal(expected_shape.begin(), expected_shape.end(), tensor.shape.begin(), tensor.shape.end())) {
        fail("{}: tensor {}: expected shape {}, found {}", file, name, shape_text(expected_shape),
             tensor.shape_string());
    }

    if (tensor.dtype == dst_dtype) {
        parallel_copy(dst, tensor.data, tensor.nbytes);
    } else if (tensor.dtype == DType::f8_e4m3 && is_float_dtype(dst_dtype)) {
        impl_->read_fp8(tensor, fp8_, dst_dtype, dst);
    } else if (is_float_dtype(tensor.dtype) && is_float_dtype(dst_dtype)) {
        parallel_convert(tensor.dtype, tensor.data, dst_dtype, dst, tensor.numel());
    } else {
        fail(
            "{}: tensor {}: cannot convert stored dtype {} to {} (conversions exist between f32, bf16 and f16, and "
            "from block-scaled f8_e4m3 to those)",
            file, name, dtype_name(tensor.dtype), dtype_name(dst_dtype));
    }
    // Reading a tensor twice is allowed (tied embeddings read one tensor for two roles).
    entry.consumed = true;
}

size_t Checkpoint::skip_prefix(std::string_view prefix) {
    size_t count = 0;
    for (auto it = impl_->tensors.lower_bound(prefix); it != impl_->tensors.end() && it->first.starts_with(prefix);
         ++it) {
        it->second.consumed = true;
        ++count;
    }
    return count;
}

void Checkpoint::finish() const {
    std::vector<const TensorInfo*> leftovers;
    for (const auto& [name, entry] : impl_->tensors) {
        if (!entry.consumed) leftovers.push_back(entry.info);
    }
    if (leftovers.empty()) return;
    std::string listed;
    for (size_t i = 0; i < std::min(leftovers.size(), kMaxListedLeftovers); ++i) {
        listed += fmt::format("{}{} ({})", i ? ", " : "", leftovers[i]->name, leftovers[i]->file.filename().string());
    }
    if (leftovers.size() > kMaxListedLeftovers) listed += ", ...";
    fail(
        "unexpected tensors in {}: {} ({} total; never read by the model: skip them by prefix if they are "
        "intentionally unused)",
        dir_.string(), listed, leftovers.size());
}

std::map<DType, uint64_t> Checkpoint::bytes_by_dtype() const {
    std::map<DType, uint64_t> totals;
    for (const auto& [name, entry] : impl_->tensors) totals[entry.info->dtype] += entry.info->nbytes;
    return totals;
}

}  // namespace xinfer
