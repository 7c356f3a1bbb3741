#include "kv/kv_layout.h"

#include "core/status.h"

#include <limits>
#include <numeric>
#include <set>

namespace xinfer {
namespace {

// Page sizes are bytes of device memory; anything near 2^62 is a geometry mistake, and keeping
// every product below that lets the arithmetic below stay in int64 without silent wrap-around.
constexpr int64_t kMaxPageBytes = int64_t(1) << 48;

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
    int64_t product = 0;
    if (__builtin_mul_overflow(a, b, &product) || product > kMaxPageBytes)
        fail("make_kv_layout: {} overflows ({} x {} exceeds {} bytes)", what, a, b, kMaxPageBytes);
    return product;
}

bool is_kv_dtype(DType dtype) {
    // Whole-byte float types only: fp4 reports one byte per *pair*, and integer caches are not a thing.
    return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16 || dtype == DType::f8_e4m3;
}

void validate_group(const KvGroupShape& shape, size_t index, std::set<int>& seen_layers) {
    const char* kind = shape.sliding ? "sliding" : "full";
    if (shape.layers.empty()) fail("make_kv_layout: group {} ({}) has no layers", index, kind);
    if (shape.n_kv_heads <= 0 || shape.head_dim_k <= 0 || shape.head_dim_v <= 0)
        fail("make_kv_layout: group {} ({}) needs positive n_kv_heads/head_dim_k/head_dim_v, got {}/{}/{}", index, kind,
             shape.n_kv_heads, shape.head_dim_k, shape.head_dim_v);
    if (shape.sliding && shape.window <= 0)
        fail("make_kv_layout: group {} is sliding but its window is {} (expected >= 1)", index, shape.window);
    // A window on a full group means the model declared the wrong kind; refuse rather than guess.
    if (!shape.sliding && shape.window != 0)
        fail("make_kv_layout: group {} is full attention but has window {} (expected 0)", index, shape.window);
    for (int layer : shape.layers) {
        if (layer < 0) fail("make_kv_layout: group {} ({}) lists negative layer index {}", index, kind, layer);
        if (!seen_layers.insert(layer).second)
            fail("make_kv_layout: layer {} appears twice (second time in group {} ({}))", layer, index, kind);
    }
}

}  // namespace

int64_t kv_block_elements(DType dtype, int64_t tokens, int64_t n_kv_heads, int64_t head_dim) {
    // fp8: e4m3 values then one f32 scale (4 bytes = 4 elements) per row.
    const int64_t scale_elements = dtype == DType::f8_e4m3 ? 4 : 0;
    return tokens * n_kv_heads * (head_dim + scale_elements);
}

int64_t kv_bytes_per_token_per_layer(DType dtype, int64_t n_kv_heads, int64_t head_dim_k, int64_t head_dim_v) {
    return (kv_block_elements(dtype, 1, n_kv_heads, head_dim_k) + kv_block_elements(dtype, 1, n_kv_heads, head_dim_v)) *
           int64_t(dtype_size(dtype));
}

int64_t KvLayout::block_tokens() const {
    int64_t block = 1;
    for (const KvGroupLayout& group : groups) block = std::lcm(block, group.tokens_per_page);
    return block;
}

int64_t KvLayout::pages_for(int group, int64_t n_tokens) const {
    if (group < 0 || size_t(group) >= groups.size())
        fail("KvLayout::pages_for: group {} out of range (layout has {} groups)", group, groups.size());
    if (n_tokens < 0) fail("KvLayout::pages_for: group {}: negative token count {}", group, n_tokens);
    const int64_t per_page = groups[size_t(group)].tokens_per_page;
    return (n_tokens + per_page - 1) / per_page;
}

KvLayout make_kv_layout(const std::vector<KvGroupShape>& shapes, DType dtype, int64_t min_tokens_per_page) {
    if (shapes.empty()) fail("make_kv_layout: no layer groups");
    if (!is_kv_dtype(dtype))
        fail("make_kv_layout: KV dtype {} is not supported (expected f32, f16, bf16 or f8_e4m3)", dtype_name(dtype));
    if (min_tokens_per_page < 1) fail("make_kv_layout: min_tokens_per_page must be >= 1, got {}", min_tokens_per_page);

    const int64_t element_bytes = int64_t(dtype_size(dtype));
    KvLayout layout;
    layout.dtype = dtype;
    std::set<int> seen_layers;
    int64_t common_bytes = 1;       // LCM of every group's bytes per token
    int64_t largest_per_token = 0;  // the group that gets the fewest tokens per page decides the size
    for (size_t index = 0; index < shapes.size(); ++index) {
        const KvGroupShape& shape = shapes[index];
        validate_group(shape, index, seen_layers);
        KvGroupLayout group;
        group.sliding = shape.sliding;
        group.window = shape.window;
        group.n_kv_heads = shape.n_kv_heads;
        group.head_dim_k = shape.head_dim_k;
        group.head_dim_v = shape.head_dim_v;
        group.layers = shape.layers;
        const int64_t scale_bytes = dtype == DType::f8_e4m3 ? 8 : 0;  // fp8: a K and a V f32 scale per head
        const int64_t layer_bytes = checked_mul(
            int64_t(shape.n_kv_heads),
            (int64_t(shape.head_dim_k) + shape.head_dim_v) * element_bytes + scale_bytes, "bytes per token of one layer");
        group.bytes_per_token = checked_mul(layer_bytes, int64_t(shape.layers.size()), "bytes per token of a group");
        const int64_t gcd = std::gcd(common_bytes, group.bytes_per_token);
        common_bytes = checked_mul(common_bytes / gcd, group.bytes_per_token, "the LCM of the groups' bytes per token");
        largest_per_token = std::max(largest_per_token, group.bytes_per_token);
        layout.groups.push_back(std::move(group));
    }

    // Smallest multiple of the LCM that gives the largest group min_tokens_per_page tokens.
    const int64_t wanted_bytes = checked_mul(min_tokens_per_page, largest_per_token, "min_tokens_per_page x bytes");
    const int64_t multiple = (wanted_bytes + common_bytes - 1) / common_bytes;
    layout.page_bytes = checked_mul(multiple, common_bytes, "page_bytes");

    for (KvGroupLayout& group : layout.groups) {
        group.tokens_per_page = layout.page_bytes / group.bytes_per_token;
        // Per layer: K[tokens_per_page, n_kv, dk] then V[tokens_per_page, n_kv, dv] (fp8: each
        // followed by its scales), layers back to back.
        const int64_t k_elements = kv_block_elements(dtype, group.tokens_per_page, group.n_kv_heads, group.head_dim_k);
        const int64_t v_elements = kv_block_elements(dtype, group.tokens_per_page, group.n_kv_heads, group.head_dim_v);
        for (size_t i = 0; i < group.layers.size(); ++i) {
            group.k_offset.push_back(int64_t(i) * (k_elements + v_elements));
            group.v_offset.push_back(group.k_offset.back() + k_elements);
        }
        XINFER_CHECK(int64_t(group.layers.size()) * (k_elements + v_elements) == layout.page_elements(),
                     "group layers {} x (K {} + V {}) elements != page {} elements", group.layers.size(), k_elements,
                     v_elements, layout.page_elements());
    }
    return layout;
}

}  // namespace xinfer
