#include "backend/workspace.h"

namespace xinfer {

Tensor Workspace::make(DType dtype, std::initializer_list<int64_t> dims) {
    Tensor t(nullptr, dtype, dims);
    const size_t bytes = std::max<size_t>(t.nbytes(), 1);
    if (next_ == slots_.size()) slots_.emplace_back();
    Buffer& slot = slots_[next_++];
    // Grow with 25% headroom so slowly growing shapes (prefill chunks, batch sizes) settle.
    if (slot.bytes() < bytes) {
        if (backend_.live_graphs() > 0) {
            if (slot.data()) retired_.push_back(std::move(slot));
        } else {
            retired_.clear();  // no graph can point into them any more
        }
        slot = backend_.alloc(bytes + bytes / 4);
    }
    t.data = slot.data();
    return t;
}

}  // namespace xinfer
