#include "backend/op_desc.h"

#include <fmt/format.h>

namespace xinfer {

static_assert(int(DType::f32) == XINFER_DTYPE_F32 && int(DType::f16) == XINFER_DTYPE_F16 &&
                  int(DType::bf16) == XINFER_DTYPE_BF16 && int(DType::f8_e4m3) == XINFER_DTYPE_F8_E4M3 &&
                  int(DType::e8m0) == XINFER_DTYPE_E8M0 && int(DType::fp4_e2m1) == XINFER_DTYPE_FP4_E2M1 &&
                  int(DType::i32) == XINFER_DTYPE_I32 && int(DType::i64) == XINFER_DTYPE_I64 &&
                  int(DType::u8) == XINFER_DTYPE_U8,
              "xinfer_dtype numbering must match DType");

xinfer_tensor to_abi(const Tensor& t) {
    xinfer_tensor out{};
    out.data = t.data;
    out.dtype = int32_t(t.dtype);
    out.rank = t.rank;
    for (int i = 0; i < t.rank; ++i) out.shape[i] = t.shape[size_t(i)];
    return out;
}

Tensor from_abi(const xinfer_tensor& t) {
    Tensor out;
    out.data = t.data;
    out.dtype = DType(t.dtype);
    out.rank = t.rank;
    for (int i = 0; i < t.rank; ++i) out.shape[size_t(i)] = t.shape[i];
    return out;
}

xinfer_op make_op(xinfer_op_type type, int layer) {
    xinfer_op op{};
    op.type = type;
    op.layer = layer;
    return op;
}

const char* op_type_name(int type) { return xinfer_op_type_name(type); }

namespace {

// Role names of src/dst slots per op, for readable descriptions.
struct Roles {
    const char* src[8];
    const char* dst[2];
};

Roles roles_of(int type) {
    switch (type) {
        case XINFER_OP_EMBEDDING: return {{"table", "ids"}, {"out"}};
        case XINFER_OP_RMSNORM: return {{"x", "weight"}, {"out"}};
        case XINFER_OP_ADD_RMSNORM: return {{"residual", "x", "weight"}, {"out"}};
        case XINFER_OP_MATMUL: return {{"x", "w", "w_scale"}, {"y"}};
        case XINFER_OP_ROPE: return {{"x", "positions"}, {}};
        case XINFER_OP_SWIGLU: return {{"gate_up"}, {"out"}};
        case XINFER_OP_SCALE: return {{"x"}, {}};
        case XINFER_OP_ADD: return {{"x", "y"}, {}};
        case XINFER_OP_KV_STORE: return {{"k", "v", "k_cache", "v_cache"}, {}};
        case XINFER_OP_ATTENTION: return {{"q", "k_cache", "v_cache", "sinks"}, {"out"}};
        case XINFER_OP_MOE_ROUTE: return {{"logits", "bias"}, {"ids", "weights"}};
        case XINFER_OP_MOE_EXPERTS:
            return {{"x", "ids", "weights", "gate_up", "down", "gate_up_scale", "down_scale"}, {"out"}};
        case XINFER_OP_ARGMAX: return {{"logits"}, {"ids"}};
        case XINFER_OP_SAMPLE: return {{"logits", "temperature", "top_p", "top_k", "uniform"}, {"ids"}};
        case XINFER_OP_CONVERT: return {{"src"}, {"dst"}};
        case XINFER_OP_ROPE_KV_STORE: return {{"k", "v", "k_cache", "v_cache", "q", "positions"}, {}};
        case XINFER_OP_ADD_RMSNORM_MATMUL: return {{"residual", "x", "norm_weight", "w", "w_scale"}, {"y", "normed"}};
        case XINFER_OP_MOE_ROUTE_EXPERTS:
            return {{"x", "logits", "bias", "gate_up", "down", "gate_up_scale", "down_scale"}, {"out"}};
        default: return {};
    }
}

std::string describe_tensor(const char* role, const xinfer_tensor& t) {
    std::string shape;
    for (int i = 0; i < t.rank; ++i) shape += (i ? ", " : "") + std::to_string(t.shape[i]);
    return fmt::format("{} {}[{}]", role ? role : "?", dtype_name(DType(t.dtype)), shape);
}

bool present(const xinfer_tensor& t) { return t.rank > 0 || t.data != nullptr; }

}  // namespace

std::string describe_op(const xinfer_op& op) {
    const Roles roles = roles_of(op.type);
    std::string text = op_type_name(op.type);
    if (op.layer >= 0) text += fmt::format(" (layer {})", op.layer);
    std::string inputs, outputs;
    for (int i = 0; i < 8; ++i)
        if (present(op.src[i])) inputs += (inputs.empty() ? "" : ", ") + describe_tensor(roles.src[i], op.src[i]);
    for (int i = 0; i < 2; ++i)
        if (present(op.dst[i])) outputs += (outputs.empty() ? "" : ", ") + describe_tensor(roles.dst[i], op.dst[i]);
    text += ": " + inputs;
    if (!outputs.empty()) text += " -> " + outputs;
    return text;
}

uint64_t op_bytes(const xinfer_op& op) {
    // KV caches are whole pools of which an op touches a small part, so they are left out.
    const bool has_cache =
        op.type == XINFER_OP_ATTENTION || op.type == XINFER_OP_KV_STORE || op.type == XINFER_OP_ROPE_KV_STORE;
    uint64_t bytes = 0;
    for (int i = 0; i < 8; ++i) {
        const bool is_cache = has_cache && (op.type == XINFER_OP_ATTENTION ? (i == 1 || i == 2) : (i == 2 || i == 3));
        if (present(op.src[i]) && !is_cache) bytes += from_abi(op.src[i]).nbytes();
    }
    for (const xinfer_tensor& t : op.dst)
        if (present(t)) bytes += from_abi(t).nbytes();
    return bytes;
}

}  // namespace xinfer
