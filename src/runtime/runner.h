// Runner: owns the KV pool of a model — ONE buffer of n_pages × layout.page_bytes, shared by
// every layer group (src/kv/kv_layout.h) — with its KvCacheManager, and turns "these sequences
// get these new tokens" into one ForwardBatch (positions, slot mapping, per-group page tables
// from the manager) and one forward pass.
//
// Two ways to drive it:
//  - forward(): the caller (the Scheduler) has already allocated every chunk's pages in kv()
//    and commits them after the step;
//  - step(): standalone use (prompt_logits, xray, tools): allocates, runs and commits itself,
//    remembering each sequence's tokens until release().
// Not thread-safe: one owner drives it.
#pragma once

#include "backend/workspace.h"
#include "kv/kv_cache_manager.h"
#include "models/model.h"
#include "runtime/graph_runner.h"
#include "spec/drafter.h"

#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace xinfer {

// New tokens for one sequence in one step.
struct SequenceChunk {
    int seq = 0;                      // caller-chosen id, stable across steps
    int64_t start_position = 0;       // tokens of this sequence already in the cache
    std::span<const int32_t> tokens;  // appended at positions start_position...
    bool all_logits = false;          // logits for every token, else only for the last
};

struct RunnerOptions {
    // Minimum tokens per page of the group with the most bytes per token (make_kv_layout's
    // min_tokens_per_page); other groups get proportionally more tokens per page.
    int page_size = 16;
    // Pool size: n_pages if > 0, else enough pages for max_cached_tokens tokens in every group.
    int64_t max_cached_tokens = 8192;
    int64_t n_pages = 0;
    // "auto" (the model's activation dtype), "float32", "bfloat16"; fp8 is refused (no backend
    // implements fp8 caches yet).
    std::string kv_cache_dtype = "auto";
    bool enable_prefix_caching = false;
    // Hidden states every forward exports for a drafter (Drafter::feature_layers(): decoder
    // layer outputs, kFinalNormFeature for the final-normed state). Empty: none.
    std::vector<int> feature_layers;
    // Decode steps (every chunk one token) replay captured graphs on backends that support
    // capture (src/runtime/graph_runner.h); true (vLLM's --enforce-eager), or XINFER_CUDA_GRAPHS=0
    // in the environment, runs every step eagerly. Steps with a tap, feature export or an op
    // observer (profiler) always run eagerly.
    bool enforce_eager = false;
    // Decode batches up to this many sequences are captured (buckets 1, 2, 4, ..., at most 64).
    int max_graph_batch = kMaxGraphBatch;
    // Longest sequence a decode graph covers; it fixes each group's page-table width, so keep it
    // near the real limit (max_model_len). Longer sequences' steps run eagerly. 0: max_cached_tokens
    // when n_pages is 0, else the longest sequence the pool holds alone (at most kMaxGraphSeqLen).
    int64_t max_seq_len = 0;
};

// The model's layer groups as make_kv_layout shapes (same order as kv_groups_for()).
std::vector<KvGroupShape> kv_group_shapes(const ModelConfig& config);
// "auto" → activation; "float32"/"bfloat16" (and f32/bf16) → that dtype; fp8 → clear error.
DType resolve_kv_cache_dtype(const std::string& name, DType activation);

class Runner {
public:
    Runner(Model& model, Backend& backend, RunnerOptions options);
    // Captured graphs point into this object's pool and caches: it never moves.
    Runner(const Runner&) = delete;
    Runner& operator=(const Runner&) = delete;

    // One forward pass over chunks whose pages are allocated in kv(). Returns host logits
    // [n_out, vocab], rows in chunk order (every token of an all_logits chunk, else its last).
    std::vector<float> forward(std::span<const SequenceChunk> chunks, const TapFn& tap = {});
    // The same forward with the logits left on the device: [n_out, vocab] f32, valid until the
    // next forward. Pair it with download_logits() or argmax_rows(). With device_tokens
    // ([n_tokens] i32 on the device, e.g. the previous step's sampled ids) the step reads its
    // token ids from there, stream-ordered, and the chunks' host token values are not used.
    Tensor forward_on_device(std::span<const SequenceChunk> chunks, const TapFn& tap = {},
                             const Tensor& device_tokens = {});
    std::vector<float> download_logits(const Tensor& logits);
    // ids[r] = argmax of logits row r (the lowest index on ties, as greedy sampling picks),
    // computed on the device: greedy steps download n_out ids instead of n_out × vocab floats
    // (at batch 64 and vocab 152K that download and the host argmax took ~19 ms a step).
    std::vector<int32_t> argmax_rows(const Tensor& logits);
    // One token per row, drawn on the device as the host Sampler would draw it (argmax where
    // temperature ≤ 0, else with the row's uniform): sampled steps download ids only too.
    struct RowSampling {
        float temperature = 0.f, top_p = 1.f;
        int32_t top_k = 0;
        float uniform = 0.f;
    };
    std::vector<int32_t> sample_rows(const Tensor& logits, std::span<const RowSampling> rows);
    // The same two with the ids left on the device: [n_out] i32, valid for what is queued before
    // the next call or the next forward (a decode graph computes its rows' argmax itself, and
    // argmax_rows_on_device hands out those ids).
    Tensor argmax_rows_on_device(const Tensor& logits);
    Tensor sample_rows_on_device(const Tensor& logits, std::span<const RowSampling> rows);
    // Standalone: allocates the chunks' pages (throws if the pool is short), runs forward and
    // commits the tokens.
    std::vector<float> step(std::span<const SequenceChunk> chunks, const TapFn& tap = {});
    // Logits as forward_on_device; with device_tokens the chunks' tokens are read there (one token
    // per chunk, prefix caching off) and set_token() records each one's value once it is known.
    Tensor step_on_device(std::span<const SequenceChunk> chunks, const TapFn& tap = {},
                          const Tensor& device_tokens = {});
    void set_token(int seq, int64_t position, int32_t token);
    void release(int seq);  // frees a sequence of step() (no-op if unknown)

    // Whether decode steps may replay graphs (backend support, options, environment).
    bool graphs_enabled() const { return graphs_enabled_; }
    // Captures every decode bucket's graph now instead of at each bucket's first step (vLLM
    // captures at startup); writes no K/V. Returns the number captured (0 when graphs are off).
    int capture_graphs();
    GraphStats graph_stats() const { return graphs_ ? graphs_->stats() : GraphStats{}; }
    // DecodeGraphs::time_last_replay: device seconds of the last replayed decode step, alone and
    // with what a step runs around its graph.
    DecodeGraphs::ReplayTimes time_last_decode_replay(int n) {
        return graphs_ ? graphs_->time_last_replay(n) : DecodeGraphs::ReplayTimes{};
    }
    // Whether decode graphs take their inputs from (and leave their ids in) mapped host memory.
    bool decode_inputs_mapped() const { return graphs_ && graphs_->mapped_inputs(); }

    KvCacheManager& kv() { return kv_; }
    const KvCacheManager& kv() const { return kv_; }
    const KvLayout& layout() const { return kv_.layout(); }
    Model& model() { return model_; }
    Backend& backend() { return backend_; }
    size_t pool_bytes() const { return pool_.bytes(); }
    // [n_tokens of the last forward, n_features * hidden] (activation dtype, on the backend): the
    // feature_layers' outputs per token row, concatenated in order. Valid until the next forward.
    const Tensor& features() const { return features_; }

private:
    TapFn exporting_tap(int64_t n_tokens, const TapFn& user_tap);
    // Downloads t (complete on return).
    template <typename T>
    std::vector<T> download_synchronized(const Tensor& t);
    void gather_features(int64_t n_tokens);
    DecodeGraphs& decode_graphs();  // created on first use (needs the finished KV views)

    Model& model_;
    Backend& backend_;
    Workspace workspace_;  // step metadata and logits
    KvCacheManager kv_;
    Buffer pool_;                     // [n_pages, page_bytes]
    std::vector<LayerCache> caches_;  // [n_layers] views into pool_
    std::vector<int> layer_group_;    // [n_layers]
    std::vector<int> feature_layers_;
    Tensor feature_staging_;             // [n_features * n_tokens, hidden] layer-major
    Tensor features_;                    // [n_tokens, n_features * hidden]
    Buffer argmax_ids_;                  // [≥ n_out] i32 for argmax_rows()
    Buffer sampling_args_;               // [5, ≥ n_out] 4-byte columns for sample_rows(): the op's inputs, then ids
    std::unordered_map<int, std::vector<int32_t>> step_tokens_;  // step() sequences' tokens so far
    RunnerOptions options_;
    bool graphs_enabled_ = false;
    std::unique_ptr<DecodeGraphs> graphs_;  // last: destroyed (graphs first) before the pool and caches
};

}  // namespace xinfer
