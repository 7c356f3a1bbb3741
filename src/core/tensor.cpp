#include "core/tensor.h"

namespace xinfer {

std::string Tensor::shape_string() const {
    std::string s = "[";
    for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(shape[size_t(i)]);
    return s + "]";
}

}  // namespace xinfer
