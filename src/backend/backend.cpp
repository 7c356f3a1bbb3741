// Backend: each C++ op call becomes one xinfer_op run through the plugin table.
#include "backend/backend.h"

#include "backend/op_desc.h"
#include "core/status.h"

#include <chrono>

namespace xinfer {
namespace {

double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

xinfer_attention_batch to_abi(const AttentionBatch& b, int page_size) {
    xinfer_attention_batch out{};
    out.n_seqs = b.n_seqs;
    out.max_pages_per_seq = b.max_pages_per_seq;
    out.page_size = page_size;
    out.page_stride = b.page_stride;
    out.cu_q_lens = to_abi(b.cu_q_lens);
    out.kv_lens = to_abi(b.kv_lens);
    out.positions = to_abi(b.positions);
    out.page_table = to_abi(b.page_table);
    out.slot_mapping = to_abi(b.slot_mapping);
    return out;
}

}  // namespace

Backend::Backend(const xinfer_backend_api* api, int device, std::string label) : api_(api), label_(std::move(label)) {
    if (api_->device_props(device, &props_) != XINFER_OK) fail("backend {}: cannot query device {}", label_, device);
    if (api_->context_create(device, &ctx_) != XINFER_OK)
        fail("backend {}: cannot create a context on device {} ({})", label_, device, props_.name);
}

Backend::~Backend() {
    if (ctx_) api_->context_destroy(ctx_);
}

void check_tokens_are_newest_keys(const std::vector<int32_t>& cu_q_lens, const std::vector<int32_t>& kv_lens,
                                  const std::vector<int32_t>& positions) {
    XINFER_CHECK(cu_q_lens.size() == kv_lens.size() + 1 && size_t(cu_q_lens.back()) == positions.size(),
                 "attention batch: {} row offsets, {} kv lengths, {} positions", cu_q_lens.size(), kv_lens.size(),
                 positions.size());
    for (size_t s = 0; s < kv_lens.size(); ++s) {
        const int32_t first = kv_lens[s] - (cu_q_lens[s + 1] - cu_q_lens[s]);
        for (int32_t t = cu_q_lens[s]; t < cu_q_lens[s + 1]; ++t)
            XINFER_CHECK(positions[size_t(t)] == first + (t - cu_q_lens[s]),
                         "attention batch: sequence {} token {} is at position {}, not {} (its tokens must be its "
                         "newest keys, kv_len {} - q_len {} on)",
                         s, t - cu_q_lens[s], positions[size_t(t)], first + (t - cu_q_lens[s]), kv_lens[s],
                         cu_q_lens[s + 1] - cu_q_lens[s]);
    }
}

void Backend::check(int status, const char* what) {
    if (status == XINFER_OK) return;
    const char* detail = api_->last_error(ctx_);
    fail("backend {}: {} failed: {}", label_, what, detail && *detail ? detail : "no details");
}

Buffer Backend::alloc(size_t bytes) {
    void* ptr = nullptr;
    const int status = api_->alloc(ctx_, bytes, &ptr);
    if (status == XINFER_OUT_OF_MEMORY)
        fail("backend {}: out of memory allocating {} bytes ({} bytes total on {})", label_, bytes,
             props_.total_memory, props_.name);
    check(status, "alloc");
    const xinfer_backend_api* api = api_;
    void* ctx = ctx_;
    return Buffer(ptr, bytes, [api, ctx](void* p) { api->free(ctx, p); });
}

Backend::MappedBuffer Backend::alloc_mapped(size_t bytes) {
    if (!api_->alloc_mapped || !api_->free_mapped) return {};
    void *host = nullptr, *device = nullptr;
    const int status = api_->alloc_mapped(ctx_, bytes, &host, &device);
    if (status == XINFER_UNSUPPORTED) return {};
    if (status == XINFER_OUT_OF_MEMORY) fail("backend {}: out of pinned host memory allocating {} bytes", label_, bytes);
    check(status, "alloc_mapped");
    const xinfer_backend_api* api = api_;
    void* ctx = ctx_;
    return {Buffer(device, bytes, [api, ctx, host](void*) { api->free_mapped(ctx, host); }), host};
}

void Backend::upload(const Tensor& dst, const void* host_src) { check(api_->upload(ctx_, dst.data, host_src, dst.nbytes()), "upload"); }
void Backend::download(const Tensor& src, void* host_dst) {
    check(api_->download(ctx_, host_dst, src.data, src.nbytes()), "download");
}
void Backend::download_async(const Tensor& src, void* host_dst) {
    if (!has_async_downloads()) return download(src, host_dst);
    check(api_->download_async(ctx_, host_dst, src.data, src.nbytes()), "download_async");
}
void Backend::wait_downloads() {
    if (has_async_downloads()) check(api_->wait_downloads(ctx_), "wait_downloads");
}
void Backend::copy(const Tensor& dst, const Tensor& src) {
    XINFER_CHECK(dst.nbytes() == src.nbytes(), "copy of {} bytes into {}", src.nbytes(), dst.nbytes());
    check(api_->copy(ctx_, dst.data, src.data, src.nbytes()), "copy");
}
void Backend::synchronize() { check(api_->synchronize(ctx_), "synchronize"); }

double Backend::measure_copy_bandwidth_gbps() {
    double gbps = 0;
    check(api_->measure_copy_bandwidth(ctx_, &gbps), "measure_copy_bandwidth");
    return gbps;
}

bool Backend::supports(const xinfer_op& op) { return api_->supports_op(ctx_, &op) != 0; }

void Backend::run(const xinfer_op& op) {
    const double start = observer_ ? now_us() : 0;
    const int status = api_->run_op(ctx_, &op);
    if (status != XINFER_OK) {
        const char* detail = api_->last_error(ctx_);
        const std::string why = detail && *detail ? detail : "no details";
        if (status == XINFER_UNSUPPORTED)
            fail("backend {} does not support {} ({})", label_, describe_op(op), why);
        fail("backend {}: {} failed: {}", label_, describe_op(op), why);
    }
    if (observer_) observer_(op, start, now_us());
}

void Backend::embedding(const Tensor& table, const Tensor& ids, const Tensor& out) {
    xinfer_op op = make_op(XINFER_OP_EMBEDDING, layer_);
    op.src[0] = to_abi(table);
    op.src[1] = to_abi(ids);
    op.dst[0] = to_abi(out);
    run(op);
}

void Backend::rmsnorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) {
    xinfer_op op = make_op(XINFER_OP_RMSNORM, layer_);
    op.src[0] = to_abi(x);
    op.src[1] = to_abi(weight);
    op.dst[0] = to_abi(out);
    op.params.norm.eps = eps;
    run(op);
}

void Backend::add_rmsnorm(const Tensor& residual, const Tensor& x, const Tensor& weight, float eps, const Tensor& out) {
    xinfer_op op = make_op(XINFER_OP_ADD_RMSNORM, layer_);
    op.src[0] = to_abi(residual);
    op.src[1] = to_abi(x);
    op.src[2] = to_abi(weight);
    op.dst[0] = to_abi(out);
    op.params.norm.eps = eps;
    run(op);
}

void Backend::matmul(const Tensor& x, const Tensor& w, const Tensor& y, const BlockScales& w_scale) {
    xinfer_op op = make_op(XINFER_OP_MATMUL, layer_);
    op.src[0] = to_abi(x);
    op.src[1] = to_abi(w);
    op.dst[0] = to_abi(y);
    if (!w_scale.empty()) {
        op.src[2] = to_abi(w_scale.scale);
        op.params.matmul.block_rows = w_scale.block_rows;
        op.params.matmul.block_cols = w_scale.block_cols;
    }
    run(op);
}

void Backend::add_rmsnorm_matmul(const Tensor& residual, const Tensor& x, const Tensor& norm_weight, float eps,
                                 const Tensor& normed, const Tensor& w, const Tensor& y, const BlockScales& w_scale) {
    xinfer_op op = make_op(XINFER_OP_ADD_RMSNORM_MATMUL, layer_);
    op.src[0] = to_abi(residual);
    op.src[1] = to_abi(x);  // absent (rank 0, NULL) when x is empty
    op.src[2] = to_abi(norm_weight);
    op.src[3] = to_abi(w);
    op.dst[0] = to_abi(y);
    op.dst[1] = to_abi(normed);
    op.params.norm_matmul.eps = eps;
    if (!w_scale.empty()) {
        op.src[4] = to_abi(w_scale.scale);
        op.params.norm_matmul.block_rows = w_scale.block_rows;
        op.params.norm_matmul.block_cols = w_scale.block_cols;
    }
    if (supports(op)) return run(op);
    if (x.data) {
        add_rmsnorm(residual, x, norm_weight, eps, normed);
    } else {
        rmsnorm(residual, norm_weight, eps, normed);
    }
    matmul(normed, w, y, w_scale);
}

void Backend::rope(const Tensor& x, const Tensor& positions, const RopeParams& params) {
    xinfer_op op = make_op(XINFER_OP_ROPE, layer_);
    op.src[0] = to_abi(x);
    op.src[1] = to_abi(positions);
    op.params.rope.rotary_dim = params.rotary_dim;
    op.params.rope.theta = params.theta;
    run(op);
}

void Backend::swiglu(const Tensor& gate_up, const Tensor& out) {
    xinfer_op op = make_op(XINFER_OP_SWIGLU, layer_);
    op.src[0] = to_abi(gate_up);
    op.dst[0] = to_abi(out);
    run(op);
}

void Backend::scale(const Tensor& x, float factor) {
    xinfer_op op = make_op(XINFER_OP_SCALE, layer_);
    op.src[0] = to_abi(x);
    op.params.scale.factor = factor;
    run(op);
}

void Backend::add(const Tensor& x, const Tensor& y) {
    xinfer_op op = make_op(XINFER_OP_ADD, layer_);
    op.src[0] = to_abi(x);
    op.src[1] = to_abi(y);
    run(op);
}

void Backend::kv_store(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                       const AttentionBatch& batch) {
    xinfer_op op = make_op(XINFER_OP_KV_STORE, layer_);
    op.src[0] = to_abi(k);
    op.src[1] = to_abi(v);
    op.src[2] = to_abi(k_cache);
    op.src[3] = to_abi(v_cache);
    op.batch = to_abi(batch, int(k_cache.dim(1)));
    run(op);
}

void Backend::rope_kv_store(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                            const RopeParams& rope_params, float value_scale, const Tensor& k_cache,
                            const Tensor& v_cache, const AttentionBatch& batch) {
    xinfer_op op = make_op(XINFER_OP_ROPE_KV_STORE, layer_);
    op.src[0] = to_abi(k);
    op.src[1] = to_abi(v);
    op.src[2] = to_abi(k_cache);
    op.src[3] = to_abi(v_cache);
    op.src[4] = to_abi(q);
    op.src[5] = to_abi(positions);
    op.params.rope_kv_store.rotary_dim = rope_params.rotary_dim;
    op.params.rope_kv_store.theta = rope_params.theta;
    op.params.rope_kv_store.value_scale = value_scale;
    op.batch = to_abi(batch, int(k_cache.dim(1)));
    if (supports(op)) return run(op);
    // The four ops. q and k adjacent in memory (one token's [q | k | v] projection row) rotate in
    // one launch.
    const bool adjacent = q.dim(0) == 1 && static_cast<const char*>(q.data) + q.nbytes() == k.data &&
                          q.dtype == k.dtype && q.dim(2) == k.dim(2);
    if (adjacent) {
        rope(Tensor(q.data, q.dtype, {1, q.dim(1) + k.dim(1), q.dim(2)}), positions, rope_params);
    } else {
        rope(q, positions, rope_params);
        rope(k, positions, rope_params);
    }
    if (value_scale != 1.f) scale(v, value_scale);
    kv_store(k, v, k_cache, v_cache, batch);
}

void Backend::attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& sinks,
                        const AttentionBatch& batch, const AttentionParams& params, const Tensor& out) {
    xinfer_op op = make_op(XINFER_OP_ATTENTION, layer_);
    op.src[0] = to_abi(q);
    op.src[1] = to_abi(k_cache);
    op.src[2] = to_abi(v_cache);
    op.src[3] = to_abi(sinks);
    op.dst[0] = to_abi(out);
    xinfer_attention_params& p = op.params.attention;
    p.n_q_heads = params.n_q_heads;
    p.n_kv_heads = params.n_kv_heads;
    p.head_dim_k = params.head_dim_k;
    p.head_dim_v = params.head_dim_v;
    p.softmax_scale = params.softmax_scale;
    p.window = params.window;
    p.causal = params.causal ? 1 : 0;
    p.k_scale = 1.f;
    p.v_scale = 1.f;
    op.batch = to_abi(batch, params.page_size);
    run(op);
}

xinfer_route_params to_abi(const RouterParams& params) {
    xinfer_route_params p{};
    p.scoring = params.scoring == RouterParams::Scoring::sigmoid ? 1 : 0;
    p.top_k = params.top_k;
    p.n_group = params.n_group;
    p.topk_group = params.topk_group;
    p.norm_topk_prob = params.norm_topk_prob ? 1 : 0;
    p.routed_scaling_factor = params.routed_scaling_factor;
    return p;
}

RouterParams router_params(const xinfer_route_params& p) {
    RouterParams out;
    out.scoring = p.scoring == 1 ? RouterParams::Scoring::sigmoid : RouterParams::Scoring::softmax;
    out.top_k = p.top_k;
    out.n_group = p.n_group;
    out.topk_group = p.topk_group;
    out.norm_topk_prob = p.norm_topk_prob != 0;
    out.routed_scaling_factor = p.routed_scaling_factor;
    return out;
}

namespace {

// The slots MOE_EXPERTS and MOE_ROUTE_EXPERTS share: x, gate_up, down, their scales and out.
// Returns the scale blocks; one pair serves both weights, so they must agree.
const BlockScales& set_expert_slots(xinfer_op& op, const Tensor& x, const Tensor& gate_up, const Tensor& down,
                                    const Tensor& out, const BlockScales& gate_up_scale, const BlockScales& down_scale) {
    XINFER_CHECK(gate_up_scale.empty() || down_scale.empty() ||
                     (gate_up_scale.block_rows == down_scale.block_rows &&
                      gate_up_scale.block_cols == down_scale.block_cols),
                 "moe_experts: gate_up scale blocks {}x{} differ from down's {}x{}", gate_up_scale.block_rows,
                 gate_up_scale.block_cols, down_scale.block_rows, down_scale.block_cols);
    op.src[0] = to_abi(x);
    op.src[3] = to_abi(gate_up);
    op.src[4] = to_abi(down);
    if (!gate_up_scale.empty()) op.src[5] = to_abi(gate_up_scale.scale);
    if (!down_scale.empty()) op.src[6] = to_abi(down_scale.scale);
    op.dst[0] = to_abi(out);
    return gate_up_scale.empty() ? down_scale : gate_up_scale;
}

}  // namespace

void Backend::moe_route(const Tensor& logits, const Tensor& bias, const RouterParams& params, const Tensor& expert_ids,
                        const Tensor& expert_weights) {
    xinfer_op op = make_op(XINFER_OP_MOE_ROUTE, layer_);
    op.src[0] = to_abi(logits);
    op.src[1] = to_abi(bias);
    op.dst[0] = to_abi(expert_ids);
    op.dst[1] = to_abi(expert_weights);
    op.params.route = to_abi(params);
    run(op);
}

void Backend::moe_experts(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights, const Tensor& gate_up,
                          const Tensor& down, const Tensor& out, const BlockScales& gate_up_scale,
                          const BlockScales& down_scale) {
    xinfer_op op = make_op(XINFER_OP_MOE_EXPERTS, layer_);
    const BlockScales& blocks = set_expert_slots(op, x, gate_up, down, out, gate_up_scale, down_scale);
    op.src[1] = to_abi(expert_ids);
    op.src[2] = to_abi(expert_weights);
    op.params.matmul.block_rows = blocks.block_rows;
    op.params.matmul.block_cols = blocks.block_cols;
    run(op);
}

void Backend::moe_route_experts(const Tensor& x, const Tensor& logits, const Tensor& bias, const RouterParams& params,
                                const Tensor& expert_ids, const Tensor& expert_weights, const Tensor& gate_up,
                                const Tensor& down, const Tensor& out, const BlockScales& gate_up_scale,
                                const BlockScales& down_scale) {
    xinfer_op op = make_op(XINFER_OP_MOE_ROUTE_EXPERTS, layer_);
    const BlockScales& blocks = set_expert_slots(op, x, gate_up, down, out, gate_up_scale, down_scale);
    op.src[1] = to_abi(logits);
    op.src[2] = to_abi(bias);
    op.params.route_experts.route = to_abi(params);
    op.params.route_experts.block_rows = blocks.block_rows;
    op.params.route_experts.block_cols = blocks.block_cols;
    if (supports(op)) return run(op);
    moe_route(logits, bias, params, expert_ids, expert_weights);
    moe_experts(x, expert_ids, expert_weights, gate_up, down, out, gate_up_scale, down_scale);
}

void Backend::argmax(const Tensor& logits, const Tensor& ids) {
    xinfer_op op = make_op(XINFER_OP_ARGMAX, layer_);
    op.src[0] = to_abi(logits);
    op.dst[0] = to_abi(ids);
    run(op);
}

void Backend::sample(const Tensor& logits, const Tensor& temperature, const Tensor& top_p, const Tensor& top_k,
                     const Tensor& uniform, const Tensor& ids) {
    xinfer_op op = make_op(XINFER_OP_SAMPLE, layer_);
    op.src[0] = to_abi(logits);
    op.src[1] = to_abi(temperature);
    op.src[2] = to_abi(top_p);
    op.src[3] = to_abi(top_k);
    op.src[4] = to_abi(uniform);
    op.dst[0] = to_abi(ids);
    run(op);
}

void Backend::graph_begin() {
    XINFER_CHECK(has_graphs(), "backend {} has no graph capture", label_);
    check(api_->graph_begin(ctx_), "graph_begin");
}
void* Backend::graph_end() {
    void* graph = nullptr;
    check(api_->graph_end(ctx_, &graph), "graph_end");
    if (graph) ++live_graphs_;
    return graph;
}
void Backend::graph_launch(void* graph) { check(api_->graph_launch(ctx_, graph), "graph_launch"); }
void Backend::graph_destroy(void* graph) {
    if (!graph) return;
    api_->graph_destroy(ctx_, graph);
    --live_graphs_;
}

void* Backend::event_record() {
    void* event = nullptr;
    check(api_->event_record(ctx_, &event), "event_record");
    return event;
}
float Backend::event_elapsed_ms(void* start, void* end) {
    float ms = 0;
    check(api_->event_elapsed_ms(ctx_, start, end, &ms), "event_elapsed_ms");
    return ms;
}
void Backend::event_destroy(void* event) { api_->event_destroy(ctx_, event); }
void Backend::set_layer(int layer) {
    if (layer == layer_) return;
    if (layer_ >= 0) range_pop();
    if (layer >= 0) range_push(fmt::format("layer {}", layer).c_str());
    layer_ = layer;
}

void Backend::range_push(const char* name) {
    if (api_->range_push) api_->range_push(ctx_, name);
}
void Backend::range_pop() {
    if (api_->range_pop) api_->range_pop(ctx_);
}

}  // namespace xinfer
