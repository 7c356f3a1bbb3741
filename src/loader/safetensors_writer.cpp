#include "loader/safetensors_writer.h"

#include "core/status.h"

#include <algorithm>
#include <fstream>
#include <set>

namespace xinfer {

std::string safetensors_dtype_name(DType dtype) {
    switch (dtype) {
        case DType::f32: return "F32";
        case DType::f16: return "F16";
        case DType::bf16: return "BF16";
        case DType::f8_e4m3: return "F8_E4M3";
        case DType::e8m0: return "F8_E8M0";
        case DType::i32: return "I32";
        case DType::i64: return "I64";
        case DType::u8: return "U8";
        case DType::fp4_e2m1: break;
    }
    fail("dtype {} has no safetensors name (store packed fp4 as U8)", dtype_name(dtype));
}

void write_safetensors(const std::filesystem::path& path, const std::vector<SafetensorsEntry>& tensors,
                       const nlohmann::json& metadata) {
    // Larger elements first keeps every tensor aligned to its own element size without padding
    // (the format forbids holes in the data section). This is the order Python's safetensors uses.
    std::vector<const SafetensorsEntry*> order;
    std::set<std::string> seen;
    for (const SafetensorsEntry& entry : tensors) {
        if (!seen.insert(entry.name).second) fail("{}: tensor {} given twice", path.string(), entry.name);
        if (entry.name == "__metadata__") fail("{}: '__metadata__' is not a valid tensor name", path.string());
        order.push_back(&entry);
    }
    std::stable_sort(order.begin(), order.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
        if (dtype_size(a->dtype) != dtype_size(b->dtype)) return dtype_size(a->dtype) > dtype_size(b->dtype);
        return a->name < b->name;
    });

    nlohmann::json header = nlohmann::json::object();
    std::vector<uint64_t> sizes;
    uint64_t offset = 0;
    for (const SafetensorsEntry* entry : order) {
        uint64_t numel = 1;
        for (int64_t dim : entry->shape) {
            if (dim < 0) fail("{}: tensor {}: negative dimension {}", path.string(), entry->name, dim);
            numel *= uint64_t(dim);
        }
        const uint64_t nbytes = numel * dtype_size(entry->dtype);
        if (nbytes > 0 && entry->data == nullptr) fail("{}: tensor {}: data is null", path.string(), entry->name);
        header[entry->name] = {{"dtype", safetensors_dtype_name(entry->dtype)},
                               {"shape", entry->shape},
                               {"data_offsets", {offset, offset + nbytes}}};
        sizes.push_back(nbytes);
        offset += nbytes;
    }
    if (!metadata.is_null()) {
        bool all_strings = metadata.is_object();
        for (const auto& item : metadata.items()) all_strings = all_strings && item.value().is_string();
        if (!all_strings) fail("{}: __metadata__ must be an object of strings, got {}", path.string(), metadata.dump());
        header["__metadata__"] = metadata;
    }

    std::string header_text = header.dump();
    header_text.append((8 - header_text.size() % 8) % 8, ' ');
    const uint64_t header_length = header_text.size();
    uint8_t length_bytes[8];
    for (int i = 0; i < 8; ++i) length_bytes[i] = uint8_t(header_length >> (8 * i));  // little-endian

    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) fail("{}: cannot open for writing", path.string());
    out.write(reinterpret_cast<const char*>(length_bytes), 8);
    out.write(header_text.data(), std::streamsize(header_text.size()));
    for (size_t i = 0; i < order.size(); ++i) {
        out.write(static_cast<const char*>(order[i]->data), std::streamsize(sizes[i]));
    }
    out.close();
    if (!out) fail("{}: write failed", path.string());
}

}  // namespace xinfer
