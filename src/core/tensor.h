// Tensor: a non-owning, row-major, contiguous view of device or host memory.
// Buffer: an owning allocation made by a Backend. Tensors never own memory, so passing them
// by value is free and lifetimes are decided by whoever holds the Buffer.
#pragma once

#include "core/dtype.h"
#include "core/status.h"

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

namespace xinfer {

constexpr int kMaxRank = 4;

struct Tensor {
    void* data = nullptr;
    DType dtype = DType::f32;
    int rank = 0;
    std::array<int64_t, kMaxRank> shape{};  // shape[0] is the outermost (slowest) dimension

    Tensor() = default;
    Tensor(void* data_, DType dtype_, std::initializer_list<int64_t> dims) : data(data_), dtype(dtype_) {
        XINFER_CHECK(dims.size() <= kMaxRank, "rank {} > {}", dims.size(), kMaxRank);
        for (int64_t d : dims) shape[size_t(rank++)] = d;
    }

    int64_t dim(int i) const { return shape[size_t(i < 0 ? rank + i : i)]; }
    int64_t numel() const {
        int64_t n = 1;
        for (int i = 0; i < rank; ++i) n *= shape[size_t(i)];
        return n;
    }
    // Last dimension, and the product of all others: every tensor is also a 2-D matrix.
    int64_t cols() const { return rank == 0 ? 1 : shape[size_t(rank - 1)]; }
    int64_t rows() const { return cols() == 0 ? 0 : numel() / cols(); }
    size_t row_bytes() const { return dtype_row_bytes(dtype, cols()); }
    size_t nbytes() const { return size_t(rows()) * row_bytes(); }

    template <typename T>
    T* as() const { return static_cast<T*>(data); }

    // Same memory, new shape of equal element count.
    Tensor reshape(std::initializer_list<int64_t> dims) const {
        Tensor t(data, dtype, dims);
        XINFER_CHECK(t.numel() == numel(), "reshape {} -> {} elements", numel(), t.numel());
        return t;
    }
    // Rows [begin, begin + count) along dimension 0.
    Tensor slice(int64_t begin, int64_t count) const {
        XINFER_CHECK(rank >= 1 && begin >= 0 && begin + count <= shape[0], "slice [{}, {}) of dim {}", begin,
                     begin + count, shape[0]);
        Tensor t = *this;
        const size_t stride = nbytes() / size_t(shape[0] == 0 ? 1 : shape[0]);
        t.data = static_cast<char*>(data) + size_t(begin) * stride;
        t.shape[0] = count;
        return t;
    }
    std::string shape_string() const;
};

// An owning allocation. Movable, not copyable; the deleter returns memory to its backend.
class Buffer {
public:
    Buffer() = default;
    Buffer(void* data, size_t bytes, std::function<void(void*)> deleter)
        : data_(data), bytes_(bytes), deleter_(std::move(deleter)) {}
    Buffer(Buffer&& other) noexcept { *this = std::move(other); }
    Buffer& operator=(Buffer&& other) noexcept {
        if (this != &other) {
            reset();
            data_ = other.data_;
            bytes_ = other.bytes_;
            deleter_ = std::move(other.deleter_);
            other.data_ = nullptr;
            other.bytes_ = 0;
        }
        return *this;
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { reset(); }

    void* data() const { return data_; }
    size_t bytes() const { return bytes_; }
    void reset() {
        if (data_ && deleter_) deleter_(data_);
        data_ = nullptr;
        bytes_ = 0;
    }

private:
    void* data_ = nullptr;
    size_t bytes_ = 0;
    std::function<void(void*)> deleter_;
};

}  // namespace xinfer
