// Runner: owns the KV cache memory of a model and turns "these sequences get these new
// tokens" into one ForwardBatch (positions, slot mapping, per-group page tables) and one
// forward pass.
#pragma once

#include "backend/workspace.h"
#include "kv/kv_manager.h"
#include "models/model.h"

#include <span>
#include <vector>

namespace xinfer {

// New tokens for one sequence in one step.
struct SequenceChunk {
    int seq = 0;                     // caller-chosen id, stable across steps
    int64_t start_position = 0;      // tokens of this sequence already in the cache
    std::span<const int32_t> tokens; // appended at positions start_position...
    bool all_logits = false;         // logits for every token, else only for the last
};

struct RunnerOptions {
    int page_size = 16;                // tokens per KV page
    int64_t max_cached_tokens = 8192;  // per layer group, over all sequences
};

class Runner {
public:
    Runner(Model& model, Backend& backend, RunnerOptions options);

    // One forward pass over all chunks. Returns host logits [n_out, vocab], rows in chunk
    // order (every token of an all_logits chunk, else its last token). Throws if the KV cache
    // cannot hold the sequences.
    std::vector<float> step(std::span<const SequenceChunk> chunks, const TapFn& tap = {});
    void release(int seq) { kv_.release(seq); }
    const KvManager& kv() const { return kv_; }
    Model& model() { return model_; }

private:
    Model& model_;
    Backend& backend_;
    std::vector<KvGroupSpec> groups_;
    Workspace workspace_;  // step metadata and logits
    KvManager kv_;
    std::vector<Buffer> cache_buffers_;
    std::vector<LayerCache> caches_;  // [n_layers]
    std::vector<int> layer_group_;    // [n_layers]
};

}  // namespace xinfer
