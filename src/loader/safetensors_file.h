// One safetensors file, mmap'd read-only, with its header validated (see Checkpoint for the
// rules). Checkpoint owns one of these per shard; tools may use it directly for single files
// such as activation dumps.
#pragma once

#include "loader/checkpoint.h"

#include <filesystem>
#include <memory>
#include <vector>

namespace xinfer {

class SafetensorsFile {
public:
    // Maps `path` and validates its header: the header length fits in the file, the header is a
    // JSON object, every dtype is known, no dimension is negative, every byte range is exactly
    // numel × element size, lies inside the file, and the ranges tile the data section without
    // overlaps, holes or trailing bytes (the same rule as the reference safetensors library).
    // Throws Error naming the file, the tensor, and the expected and actual values.
    static std::unique_ptr<SafetensorsFile> open(const std::filesystem::path& path);
    ~SafetensorsFile();
    SafetensorsFile(const SafetensorsFile&) = delete;
    SafetensorsFile& operator=(const SafetensorsFile&) = delete;

    const std::filesystem::path& path() const { return path_; }
    // Sorted by name (the header is a JSON object, whose order carries no meaning). Their `data`
    // pointers point into the mapping and stay valid while this object lives.
    const std::vector<TensorInfo>& tensors() const { return tensors_; }
    size_t file_size() const { return size_; }

private:
    SafetensorsFile() = default;
    void parse_header();

    std::filesystem::path path_;
    const uint8_t* base_ = nullptr;  // the mapping, PROT_READ: nothing here ever writes to it
    size_t size_ = 0;
    std::vector<TensorInfo> tensors_;
};

}  // namespace xinfer
