// Conversions between the C++ Tensor and the ABI's xinfer_tensor / xinfer_op, and readable
// descriptions of ops for error messages, the profiler and ops-test.
#pragma once

#include "core/tensor.h"
#include "xinfer/backend_abi.h"

#include <string>

namespace xinfer {

xinfer_tensor to_abi(const Tensor& t);
Tensor from_abi(const xinfer_tensor& t);
// An op with every tensor absent and the given type/layer.
xinfer_op make_op(xinfer_op_type type, int layer);
const char* op_type_name(int type);     // "attention"; "unknown" for out-of-range values
// "attention (layer 3): q f32[7, 4, 24], k_cache f32[16, 4, 2, 24], ... -> out f32[7, 4, 16]"
std::string describe_op(const xinfer_op& op);
// Bytes of the op's tensors (inputs read + outputs written; KV caches excluded), for
// achieved-bandwidth figures.
uint64_t op_bytes(const xinfer_op& op);

}  // namespace xinfer
