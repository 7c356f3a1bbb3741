// Step-scoped device memory that is reused across steps. The i-th tensor requested after
// reset() gets slot i, which keeps its allocation from earlier steps when large enough — a
// forward pass requests the same sequence of tensors every step, so steady-state steps
// allocate nothing (and on the CPU fault in no fresh pages). Tensors are valid until the next
// reset(). Required for CUDA-graph replay, which needs stable addresses: while the backend has
// live graphs, a slot that must grow keeps its old buffer alive (retired) because a captured
// graph may still point into it.
#pragma once

#include "backend/backend.h"

#include <vector>

namespace xinfer {

class Workspace {
public:
    explicit Workspace(Backend& backend) : backend_(backend) {}
    void reset() { next_ = 0; }
    Tensor make(DType dtype, std::initializer_list<int64_t> dims);

private:
    Backend& backend_;
    std::vector<Buffer> slots_;
    std::vector<Buffer> retired_;  // outgrown slots kept for live graphs
    size_t next_ = 0;
};

}  // namespace xinfer
