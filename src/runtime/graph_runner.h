// Decode steps as captured device graphs (vLLM's CUDA-graph runner, llama.cpp's graph reuse).
//
// A decode step (every sequence one new token) issues a few thousand small ops whose launch
// cost rivals their run time at small batches. DecodeGraphs captures the forward pass once per
// batch bucket (1, 2, 4, ... sequences) and replays it. A graph is the whole step on the device:
//  1. it copies the step's inputs (token ids, positions, kv lens, page tables, slot mapping) from
//     an input buffer into the metadata its ops read;
//  2. the forward pass, into fixed logits;
//  3. the argmax of its rows, written straight into the token slots of the *other* input buffer,
//     which the next step reads.
// The two input buffers alternate step by step (each bucket has a graph for either), so the host
// fills the next step's inputs while this step's graph may still read its own. Where the backend
// has mapped host memory (pinned, on CUDA) the input buffers are that memory: the host writes the
// inputs in place and reads the ids from there, and an overlapped decode step (its tokens the
// previous step's ids) queues nothing but its graph. Elsewhere they are device buffers the host
// uploads into, and the ids are downloaded.
//
// What makes a replay valid:
//  - every pointer is stable: metadata and logits live in buffers owned here; the model's
//    Workspace hands out the same slots for the same op sequence, and keeps outgrown slots
//    alive while graphs exist; the KV pool and weights never move;
//  - every shape is fixed per bucket: batches are padded to the bucket with inert rows (token 0,
//    position 0, kv_len 0, slot -1, page-table row -1: they write no K/V and attend to nothing),
//    and each group's page table is always `width` pages wide (enough for max_seq_len tokens),
//    so host-side launch decisions made from shapes (attention's KV split count) stay valid;
//  - the graph is captured right after an eager run of the same shapes, which sizes the
//    plugin's scratch and the workspace slots (nothing may allocate during capture).
// A replay therefore runs exactly the kernels of the eager padded step and gives bit-identical
// logits; it differs from an unpadded eager step only by the kernels' shape-dependent choices.
//
// Not thread-safe: owned and driven by one Runner.
#pragma once

#include "kv/kv_cache_manager.h"
#include "models/model.h"

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace xinfer {

struct SequenceChunk;

// Batch buckets a decode graph is captured for: 1, 2, 4, ... up to the first ≥ max_batch, at
// most kMaxGraphBatch (larger decode batches run eagerly: launch overhead is a small share there).
constexpr int kMaxGraphBatch = 64;
std::vector<int> decode_graph_batch_sizes(int max_batch);
// Default cap on the sequence length graphs cover: page tables are uploaded at full width every
// step, and past this context attention, not launch overhead, dominates a decode step.
constexpr int64_t kMaxGraphSeqLen = 32768;
// The smallest bucket holding n sequences; 0 if none does.
int pick_graph_batch(std::span<const int> sizes, int n);
// True when every chunk appends exactly one token (the steps graphs cover).
bool is_plain_decode(std::span<const SequenceChunk> chunks);
// XINFER_CUDA_GRAPHS=0 (or "false", "off") in the environment disables graphs.
bool graphs_disabled_by_env();

// Where one bucket's metadata sits in the int32 metadata buffer (element offsets). The bucket's
// fields are packed from offset 0 so that a step uploads one contiguous range.
struct DecodeMetadataLayout {
    int batch = 0;                       // rows = sequences = tokens
    std::vector<int64_t> widths;         // [groups] page-table width (pages)
    int64_t token_ids = 0;               // [batch]
    int64_t positions = 0;               // [batch]
    int64_t cu_q_lens = 0;               // [batch + 1]
    int64_t kv_lens = 0;                 // [batch]
    int64_t logit_rows = 0;              // [batch]
    std::vector<int64_t> page_tables;    // [groups] → [batch, widths[g]]
    std::vector<int64_t> slot_mappings;  // [groups] → [batch]
    int64_t size = 0;                    // int32 elements in all
};
DecodeMetadataLayout decode_metadata_layout(int batch, std::span<const int64_t> widths);

// One real sequence of a decode step.
struct DecodeRow {
    int32_t token = 0;
    int64_t position = 0;                              // of the new token; kv_len = position + 1
    std::vector<const std::vector<int32_t>*> tables;   // [groups] the sequence's page tables
};

// Fills `out` (resized to layout.size) with the rows' metadata, padding to layout.batch with
// inert rows. Tables longer than the width are cut (pages past the new token are never read).
// Returns false, leaving `out` unspecified, when more rows than the bucket holds are given or a
// row's new token lies beyond its group's width (the step must run eagerly). Throws if the new
// token's page is not resident (released sliding page), as the eager path does.
bool fill_decode_metadata(const DecodeMetadataLayout& layout, std::span<const DecodeRow> rows,
                          std::span<const int64_t> tokens_per_page, std::vector<int32_t>& out);

// Counters for tests and logs.
struct GraphStats {
    int64_t captures = 0;          // buckets captured (a graph for either input buffer)
    int64_t replays = 0;           // steps served by a replay
    int64_t capture_steps = 0;     // steps run eagerly (padded) right before their bucket's capture
    int64_t failed_captures = 0;   // buckets whose capture failed (they run eagerly from then on)
};

class DecodeGraphs {
public:
    // caches and layer_group are the Runner's (they must outlive this object). max_seq_len fixes
    // each group's page-table width.
    DecodeGraphs(Model& model, Backend& backend, const KvCacheManager& kv, const std::vector<LayerCache>& caches,
                 const std::vector<int>& layer_group, int max_batch, int64_t max_seq_len);
    ~DecodeGraphs();
    DecodeGraphs(const DecodeGraphs&) = delete;
    DecodeGraphs& operator=(const DecodeGraphs&) = delete;

    // Runs a plain decode step (pages allocated in kv) through its bucket's graph, capturing it
    // first if needed; returns the device logits [chunks.size(), vocab] (valid until the next
    // step; not synchronized). nullopt when the step does not fit a graph (too many sequences, a
    // sequence beyond max_seq_len, a failed capture): the caller runs it eagerly.
    // device_tokens ([chunks.size()] i32 on the device), when given, replace the chunks' token
    // ids (see Runner::forward_on_device); the last step's ids (argmax_of) cost nothing to feed.
    // With device_tokens the host writes this step's inputs while the last step may still run,
    // into the buffer the step before it read: that step must be complete (its ids waited for),
    // as overlapped decode has it. Without them, the step waits for the device first.
    std::optional<Tensor> forward(std::span<const SequenceChunk> chunks, const Tensor& device_tokens = {});
    // Captures every bucket not captured yet, each from an eager run of an all-inert batch
    // (writes no K/V), as vLLM does at startup. Returns the number captured.
    int capture_all();

    // Device seconds per step of the graph the last step launched, relaunched `n` times back to
    // back between two events, alone and then with what an overlapped decode step queues around
    // it (the inputs' upload without mapped memory, the ids' download): what the device spends
    // between two graphs. The graph rewrites the same K/V slots and ids with the same values, so
    // the cache is unchanged. All 0 when no graph was launched or the backend has no events.
    struct ReplayTimes {
        double graph = 0;  // the graph alone (its inputs' copy and its rows' argmax included)
        double step = 0;   // + the stream operations of an overlapped step
    };
    ReplayTimes time_last_replay(int n);
    // Every decode graph ends with the argmax of its rows (ids [bucket] i32), so that a greedy
    // step launches nothing after it: H200, batch-1 MiMo decode, the two argmax kernels took 12-15
    // µs of device time after the graph (docs/perf/2026-12-02-h200-session23.md). Returns those
    // ids (in mapped memory where the backend has it) when `logits` are the last step's (what
    // forward returned), else nullopt.
    std::optional<Tensor> argmax_of(const Tensor& logits) const;
    // Whether the input buffers are mapped host memory (see the top of this file).
    bool mapped_inputs() const { return inputs_[0].host != nullptr; }
    const std::vector<int>& batch_sizes() const { return sizes_; }
    const std::vector<int64_t>& widths() const { return widths_; }
    const GraphStats& stats() const { return stats_; }

private:
    struct Bucket {
        DecodeMetadataLayout layout;
        void* graphs[2] = {nullptr, nullptr};  // [parity]: reads inputs_[parity]
        bool failed = false;
    };
    ForwardBatch batch_for(const Bucket& bucket) const;
    Tensor logits_for(int rows) const;
    // [rows] i32: the token slots of inputs_[parity], where the graph of the other parity writes its ids.
    Tensor tokens_of(int parity, int rows) const;
    // Writes staging_ into inputs_[parity] from element `first` on (0, or past the real rows'
    // token slots when their tokens come from the device).
    void write_inputs(const Bucket& bucket, int parity, int64_t first);
    // What a graph of this parity holds: the inputs' copy, the forward pass, the argmax.
    void run_step(const Bucket& bucket, int parity);
    // Eager padded run of the step, then capture of both parities. The eager run's logits and
    // ids are the step's result either way.
    void capture(Bucket& bucket, int parity);

    Model& model_;
    Backend& backend_;
    const KvCacheManager& kv_;
    const std::vector<LayerCache>& caches_;
    const std::vector<int>& layer_group_;
    std::vector<int> sizes_;
    std::vector<int64_t> widths_;           // [groups] page-table width
    std::vector<int64_t> tokens_per_page_;  // [groups]
    std::vector<Bucket> buckets_;           // [sizes_.size()]
    Bucket* last_replayed_ = nullptr;       // the bucket whose graph the last step launched (it read inputs_[1 - parity_])
    Buffer metadata_;                       // int32 [largest bucket's layout.size]: what the ops read
    Backend::MappedBuffer inputs_[2];       // int32 [largest bucket's layout.size] each, laid out as metadata_
    int parity_ = 0;                        // the inputs the next step fills
    Buffer logits_;                         // f32 [largest bucket, vocab]
    int64_t ids_rows_ = 0;                  // rows of the last step's ids (tokens_of(parity_)); 0: none
    std::vector<int32_t> staging_;          // host copy of the step's inputs
    GraphStats stats_;
};

}  // namespace xinfer
