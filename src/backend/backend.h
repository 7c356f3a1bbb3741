// The device interface the models are written against. Every op is coarse and fused, takes
// plain Tensors plus a small parameter struct, and runs asynchronously on the backend's stream
// (the CPU backend runs synchronously). The CPU backend is the oracle: every other backend is
// tested op by op against it.
//
// Conventions for all ops:
//  - Activations are f32 on the CPU backend (bf16 on GPU backends); accumulation is f32.
//  - Weights W are stored [out, in] and applied as y = x · Wᵀ (PyTorch nn.Linear layout).
//  - Integer metadata (token ids, positions, page tables) is i32.
//  - Outputs never alias inputs unless the op says "in place".
#pragma once

#include "core/tensor.h"
#include "xinfer/backend_abi.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace xinfer {

struct RopeParams {
    int rotary_dim = 0;     // rotate the first rotary_dim dims of each head (partial rotary), rest pass through
    float theta = 10000.f;  // inv_freq[j] = theta^(-2j / rotary_dim)
    // Pairing is NeoX rotate-half: (x[j], x[j + rotary_dim/2]) for j < rotary_dim/2.
};

struct AttentionParams {
    int n_q_heads = 0;
    int n_kv_heads = 0;   // GQA: query head h reads kv head h / (n_q_heads / n_kv_heads)
    int head_dim_k = 0;   // Q/K head dim (192 for MiMo)
    int head_dim_v = 0;   // V head dim (128 for MiMo); never padded to head_dim_k
    float softmax_scale = 1.f;  // applied to q·k before masking; sinks are in these scaled units
    int window = 0;       // 0: unlimited. Causal: query at position p sees keys j with p - j < window.
                          // Non-causal: |p - j| < window (symmetric; DFlash drafter blocks).
    bool causal = true;   // false: every query sees every key j < kv_len (subject to window)
    int page_size = 0;    // tokens per KV page
};

// Per-step, per-layer-group metadata shared by kv_store and attention. Built on the host by the
// KV manager and uploaded; sequences are laid out back to back in the token dimension.
struct AttentionBatch {
    int n_seqs = 0;
    int max_pages_per_seq = 0;
    Tensor cu_q_lens;     // [n_seqs + 1] i32: tokens of sequence s are rows [cu_q_lens[s], cu_q_lens[s+1])
    Tensor kv_lens;       // [n_seqs] i32: keys 0..kv_len-1 of sequence s are in its cache after kv_store
    Tensor positions;     // [n_tokens] i32: absolute position of each query token (= its key index)
    Tensor page_table;    // [n_seqs, max_pages_per_seq] i32: physical page of logical page p; -1 = not resident
    Tensor slot_mapping;  // [n_tokens] i32: page * page_size + offset where each new token's K/V goes; -1 = skip
    // Elements between consecutive pages of one layer's K (and of its V); 0 = the cache
    // tensors are contiguous [pages, page_size, n_kv, d]. Non-zero when pages of one pool hold
    // several layers (src/kv/kv_layout.h); the cache tensors then point at page 0 of the layer.
    int64_t page_stride = 0;
};

// What backend_abi.h promises backends about a batch (xinfer_attention_batch): each sequence's
// tokens are its newest keys, kv_len - q_len .. kv_len - 1 in order, so a forward's KV_STORE writes
// no older key and a backend may read those before the previous op has finished (the CUDA
// decode attention does). The batch builders call this on their host vectors; it throws naming
// the sequence and token when the promise would be broken.
void check_tokens_are_newest_keys(const std::vector<int32_t>& cu_q_lens /*[n_seqs + 1]*/,
                                  const std::vector<int32_t>& kv_lens /*[n_seqs]*/,
                                  const std::vector<int32_t>& positions /*[n_tokens]*/);

struct RouterParams {
    enum class Scoring { softmax, sigmoid };
    Scoring scoring = Scoring::softmax;
    int top_k = 1;
    int n_group = 1;         // DeepSeek group-limited routing: keep topk_group groups by the sum of
    int topk_group = 1;      //   each group's top-2 selection scores, then top_k within them
    bool norm_topk_prob = false;  // renormalise the chosen weights to sum to 1
    float routed_scaling_factor = 1.f;
    // The optional correction bias (e_score_correction_bias) is added to the scores for
    // *selection only*; weights come from the unbiased scores.
};
// RouterParams as the ABI's xinfer_route_params, and back.
xinfer_route_params to_abi(const RouterParams& params);
RouterParams router_params(const xinfer_route_params& p);

// The block scales of an f8_e4m3 weight matrix: W[r, c] = fp8(W8[r, c]) · scale[r / block_rows, c / block_cols],
// a contiguous grid (partial edge blocks at the bottom/right; per expert for stacked experts). Empty
// (scale.data == nullptr) for f32/bf16/f16 weights. block_rows/cols 0 means 128.
struct BlockScales {
    Tensor scale;        // [ceil(rows / block_rows), ceil(cols / block_cols)] f32, or [E, ...] for experts
    int block_rows = 0;  // weight rows per scale row
    int block_cols = 0;  // weight columns per scale column
    bool empty() const { return scale.data == nullptr; }
};

// The C++ face of one device context: allocation, copies, and the fused ops, each translated
// into an xinfer_op and run through the backend's plugin table (include/xinfer/backend_abi.h).
// The CPU backend is such a table too, built in, so every backend is reached the same way.
// Errors (unsupported op, kernel failure) throw Error naming the backend, the op, its layer
// and its tensor shapes. Not thread-safe: one Backend per thread of work.
class Backend {
public:
    // Creates a context on `device` of the plugin behind `api`; `label` names it in messages.
    Backend(const xinfer_backend_api* api, int device, std::string label);
    ~Backend();
    Backend(const Backend&) = delete;
    Backend& operator=(const Backend&) = delete;

    const std::string& name() const { return label_; }   // "cpu", "cuda:0"
    const xinfer_backend_api& api() const { return *api_; }
    const xinfer_device_props& props() const { return props_; }
    // The backend's natural activation dtype: f32 on host-memory backends (the reference),
    // bf16 on accelerators. Models may choose otherwise (--dtype).
    DType activation_dtype() const { return props_.host_memory ? DType::f32 : DType::bf16; }

    // ---- memory -------------------------------------------------------------------------
    Buffer alloc(size_t bytes);
    // Host memory the device reads and writes in place (backend_abi.h's alloc_mapped): ops and
    // copies take tensors over `device`, the host reads and writes `host`; download and
    // download_async from it only wait. Empty (device.data() == nullptr) where the backend has
    // none or refuses it: the caller then stages through device memory.
    struct MappedBuffer {
        Buffer device;
        void* host = nullptr;
    };
    MappedBuffer alloc_mapped(size_t bytes);
    void upload(const Tensor& dst, const void* host_src);    // dst.nbytes() bytes, read before it returns
    void download(const Tensor& src, void* host_dst);        // src.nbytes() bytes, completes before return
    // Stream-ordered download that returns at once: host_dst holds src's bytes once
    // wait_downloads() returns, which does not wait for work queued after the downloads.
    // Backends without the ABI's download_async download here, before returning.
    void download_async(const Tensor& src, void* host_dst);
    void wait_downloads();
    bool has_async_downloads() const { return api_->download_async && api_->wait_downloads; }
    void copy(const Tensor& dst, const Tensor& src);         // device to device, same byte size
    void synchronize();
    // Device memory bandwidth measured now with a large copy: (bytes read + bytes written) /
    // seconds, in GB/s (1e9). The roofline every benchmark compares against.
    double measure_copy_bandwidth_gbps();

    // ---- ops (semantics: the comments on each, and include/xinfer/backend_abi.h) ----------
    // out[t] = table[ids[t]], converted to out.dtype.
    void embedding(const Tensor& table /*[vocab, hidden]*/, const Tensor& ids /*[T] i32*/, const Tensor& out /*[T, hidden]*/);
    // out = x / sqrt(mean(x²) + eps) * weight, per row; statistics in f32.
    void rmsnorm(const Tensor& x /*[rows, n]*/, const Tensor& weight /*[n]*/, float eps, const Tensor& out /*[rows, n]*/);
    // residual += x (in place), then out = rmsnorm(residual).
    void add_rmsnorm(const Tensor& residual /*[rows, n] in/out*/, const Tensor& x /*[rows, n]*/,
                     const Tensor& weight /*[n]*/, float eps, const Tensor& out /*[rows, n]*/);
    // y = x · wᵀ. w may be f32, bf16, f16, or f8_e4m3 with its block scales (w_scale).
    void matmul(const Tensor& x /*[T, in]*/, const Tensor& w /*[out, in]*/, const Tensor& y /*[T, out]*/,
                const BlockScales& w_scale = {});
    // The norm before a projection: add_rmsnorm(residual, x, norm_weight, eps, normed) (rmsnorm of
    // residual when x is empty), then matmul(normed, w, y, w_scale). One op where the backend has
    // it (one launch instead of two on a GPU), else those two.
    void add_rmsnorm_matmul(const Tensor& residual /*[R, K] in/out*/,
                            const Tensor& x /*[R, K] or empty Tensor: plain rmsnorm*/,
                            const Tensor& norm_weight /*[K]*/, float eps, const Tensor& normed /*[R, K]*/,
                            const Tensor& w /*[N, K]*/, const Tensor& y /*[R, N]*/, const BlockScales& w_scale = {});
    // In place, on the first rotary_dim dims of every head.
    void rope(const Tensor& x /*[T, heads, head_dim] in/out*/, const Tensor& positions /*[T] i32*/, const RopeParams& params);
    // out = silu(gate) * up, with gate_up = [gate | up] along the last dim.
    void swiglu(const Tensor& gate_up /*[T, 2*I]*/, const Tensor& out /*[T, I]*/);
    void scale(const Tensor& x /*in place*/, float factor);
    void add(const Tensor& x /*[rows, n] in place*/, const Tensor& y /*[rows, n]*/);
    // Writes each new token's K/V into its slot (batch.slot_mapping).
    void kv_store(const Tensor& k /*[T, n_kv, dk]*/, const Tensor& v /*[T, n_kv, dv]*/,
                  const Tensor& k_cache /*[pages, page_size, n_kv, dk]*/, const Tensor& v_cache /*[pages, page_size, n_kv, dv]*/,
                  const AttentionBatch& batch);
    // The attention block's prologue: rope(q), rope(k), scale(v, value_scale), kv_store(k, v). One
    // op where the backend has it (one launch instead of four on a GPU), else those four.
    void rope_kv_store(const Tensor& q /*[T, n_q, dk] in/out*/, const Tensor& k /*[T, n_kv, dk] in/out*/,
                       const Tensor& v /*[T, n_kv, dv] in/out*/, const Tensor& positions /*[T] i32*/,
                       const RopeParams& rope, float value_scale, const Tensor& k_cache, const Tensor& v_cache,
                       const AttentionBatch& batch);
    // Paged attention for a batch of sequences with 1..many query tokens each. Optional sinks
    // (per query head, f32; an empty Tensor means none) add one extra logit per head to the
    // softmax whose probability is dropped.
    void attention(const Tensor& q /*[T, n_q, dk]*/, const Tensor& k_cache, const Tensor& v_cache,
                   const Tensor& sinks /*[n_q] f32 or empty*/, const AttentionBatch& batch,
                   const AttentionParams& params, const Tensor& out /*[T, n_q, dv]*/);
    // Picks top_k experts per token from router logits (f32).
    void moe_route(const Tensor& logits /*[T, E] f32*/, const Tensor& bias /*[E] f32 or empty*/, const RouterParams& params,
                   const Tensor& expert_ids /*[T, k] i32*/, const Tensor& expert_weights /*[T, k] f32*/);
    // out[t] = Σ_k weights[t,k] · down_e(silu(gate_e(x[t])) * up_e(x[t])), e = expert_ids[t,k].
    void moe_experts(const Tensor& x /*[T, H]*/, const Tensor& expert_ids /*[T, k] i32*/,
                     const Tensor& expert_weights /*[T, k] f32*/, const Tensor& gate_up /*[E, 2*I, H]*/,
                     const Tensor& down /*[E, H, I]*/, const Tensor& out /*[T, H]*/,
                     const BlockScales& gate_up_scale = {} /*[E, ceil(2I/br), ceil(H/bc)]*/,
                     const BlockScales& down_scale = {} /*[E, ceil(H/br), ceil(I/bc)]; same blocks as gate_up's*/);
    // The router and the experts: moe_route into expert_ids / expert_weights, then moe_experts. One
    // op where the backend has it (on a GPU, the expert kernels route themselves: one launch fewer,
    // and ids / weights are not written), else those two.
    void moe_route_experts(const Tensor& x /*[T, H]*/, const Tensor& logits /*[T, E] f32*/,
                           const Tensor& bias /*[E] f32 or empty*/, const RouterParams& params,
                           const Tensor& expert_ids /*[T, k] i32*/, const Tensor& expert_weights /*[T, k] f32*/,
                           const Tensor& gate_up, const Tensor& down, const Tensor& out /*[T, H]*/,
                           const BlockScales& gate_up_scale = {}, const BlockScales& down_scale = {});
    // ids[r] = argmax of logits row r (lowest index on ties): drafters propose on the device and
    // download ids instead of [rows, vocab] logits.
    void argmax(const Tensor& logits /*[R, V] f32*/, const Tensor& ids /*[R] i32*/);
    // ids[r] drawn from row r at temperature[r] with top_k[r] / top_p[r], using uniform[r] in [0, 1)
    // (argmax where temperature[r] ≤ 0); the rule is the host Sampler's (src/backend/cpu/sampling.cpp).
    void sample(const Tensor& logits /*[R, V] f32*/, const Tensor& temperature /*[R] f32*/, const Tensor& top_p /*[R] f32*/,
                const Tensor& top_k /*[R] i32*/, const Tensor& uniform /*[R] f32*/, const Tensor& ids /*[R] i32*/);

    // ---- generic entry points (ops-test, tools) ---------------------------------------------
    bool supports(const xinfer_op& op);
    void run(const xinfer_op& op);  // throws on failure, naming the op and its shapes
    // The layer tag put on every op until changed (-1: outside decoder layers); used by the
    // profiler and in error messages.
    // Changing layers also closes/opens a named range per layer for vendor profilers (NVTX on
    // CUDA: "layer 7" in Nsight Systems).
    void set_layer(int layer);
    int layer() const { return layer_; }

    // Called after every op with its descriptor and the host time spent issuing it; install
    // one to profile (nullptr removes it).
    using OpObserver = std::function<void(const xinfer_op& op, double host_start_us, double host_end_us)>;
    void set_op_observer(OpObserver observer) { observer_ = std::move(observer); }
    // A graph replay would hide every op from the observer, so graph runners run eagerly while one is set.
    bool has_op_observer() const { return bool(observer_); }

    // Optional capabilities of the plugin.
    bool has_graphs() const { return api_->graph_begin != nullptr; }
    void graph_begin();
    void* graph_end();
    void graph_launch(void* graph);
    void graph_destroy(void* graph);
    // Graphs made by graph_end and not yet destroyed. While any exist, device memory they were
    // captured with must outlive them (Workspace retires instead of freeing a grown slot).
    int live_graphs() const { return live_graphs_; }
    bool has_events() const { return api_->event_record != nullptr; }
    void* event_record();
    float event_elapsed_ms(void* start, void* end);
    void event_destroy(void* event);
    void range_push(const char* name);
    void range_pop();

private:
    void check(int status, const char* what);
    const xinfer_backend_api* api_;
    void* ctx_ = nullptr;
    std::string label_;
    xinfer_device_props props_{};
    int layer_ = -1;
    int live_graphs_ = 0;
    OpObserver observer_;
};

// The built-in CPU backend's plugin table (src/backend/cpu/cpu_abi.cpp). Uses all cores (OpenMP).
const xinfer_backend_api* cpu_backend_api();
std::unique_ptr<Backend> make_cpu_backend();

// Opens a backend by device name: "cpu", or "<plugin>" / "<plugin>:N" for device N of
// libxinfer-<plugin>.so, found (in this order) in $XINFER_PLUGIN_PATH (colon-separated
// directories), next to the running executable, and in <executable dir>/../lib. Errors name
// the plugin, where it was looked for, and why it failed (missing file, missing symbol, ABI
// version mismatch, no devices, device index out of range).
std::unique_ptr<Backend> make_backend(const std::string& device);

}  // namespace xinfer
