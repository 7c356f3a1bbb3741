// DFlash block-diffusion drafter (research/dflash.md §1, §2.1, §8).
//
// A few Qwen3-style layers that draft a whole block in ONE non-causal forward:
//   observe(): for every committed token p of a sequence, ctx_p = hidden_norm(fc(concat of the
//              target's tapped layer outputs at p)); every draft layer writes
//              k_p = RoPE_p(k_norm(W_k ctx_p)), v_p = W_v ctx_p (· value scale) into the drafter's
//              own paged KV cache ("KV injection"; no input_layernorm on this path).
//   propose(): the block [anchor, MASK × (B-1)] at positions anchor_pos … anchor_pos+B-1 of every
//              request runs through the layers in one batched forward; its queries attend, in one
//              softmax, to the injected context and to the whole block (per-layer causality and
//              window, below). The block's own K/V are written to the cache at its positions
//              transiently — never committed, and overwritten by the next injection, which is
//              exactly the reference's crop(start). After the final norm the target's lm_head
//              (or the drafter's own) scores slots 1..B-1; drafts are their argmax.
//
// Proposals are greedy (argmax) even when the target samples, as in the z-lab reference, SGLang
// and vLLM's default: verification (rejection sampling with one-hot draft probabilities) keeps
// the output distribution exact either way.
//
// Conventions (docs in research/dflash.md):
//  - feature_layers() = dflash_config.target_layer_ids, z-lab convention: id L is the OUTPUT of
//    target layer L (HF hidden_states[L + 1]). vLLM, SGLang and llama.cpp store/capture the
//    same tensor as the *input* of layer L + 1, i.e. their ids are ours + 1.
//  - The block is always block_size wide (as the reference; the drafter was trained on that
//    width); a request asking for fewer drafts gets the first max_drafts slots.
//  - Layer attention as vLLM's _resolve_layer_attention: top-level is_causal, else
//    dflash_config.causal, else a layer is causal iff its layer_types entry is
//    sliding_attention; dflash_config.use_swa makes every layer sliding (window
//    dflash_config.swa_window_size, else sliding_window). Non-causal sliding layers use a
//    window symmetric around each query: key j is visible from query p iff |p - j| < W.
//
// Two checkpoint dialects are read:
//  - z-lab: architectures ["DFlashDraftModel"], top-level block_size and num_target_layers,
//    dflash_config {target_layer_ids, mask_token_id}, optional layer_types / sliding_window.
//  - MiMo: dflash_config {use_swa, swa_window_size, attention_sink_bias, attention_value_scale}
//    (or top-level add_swa_attention_sink_bias / attention_value_scale), per-head sinks in
//    layers.N.self_attn.attention_sink_bias, and a mask-embedding sidecar in the drafter
//    directory that replaces embed(mask_token_id) on the MASK slots:
//      mask_embedding.safetensors  one tensor of [hidden] (or [1, hidden]), any float dtype
//      mask_embedding.bin          exactly hidden little-endian float32 values
//    vLLM reads mask_embedding.pt (a torch pickle); that file is refused with the one-line
//    command that converts it.
// Embedding and lm_head are the target's unless the drafter ships embed_tokens.weight /
// lm_head.weight. Draft vocabularies (d2t) are not supported.
//
// A sequence first observed mid-context (the target skipped a cached prefix) is fine for an
// all-sliding drafter: the engine keeps context_window() positions out of the hit, and keys
// older than the window are never read. A drafter with full-attention layers keeps its own
// prefix cache of the context K/V it injected (pages hashed by token content, like the
// target's; the engine aligns the target's hits to its blocks) and restores the skipped prefix
// from it. If that cache lacks the prefix (evicted), and for any later gap, the sequence gets
// no drafts until release(): speculation then degrades to plain decoding.
//
// Not thread-safe: the engine loop owns it. Runs through the Backend facade only.
#pragma once

#include "backend/workspace.h"
#include "kv/kv_cache_manager.h"
#include "loader/checkpoint.h"
#include "spec/drafter.h"

#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace xinfer {

struct DFlashLayerAttention {
    int window = 0;       // 0: full attention; else keys within W of the query (see above)
    bool causal = false;  // false: block queries also see later block slots
};

// Everything read from the drafter's config.json (and sidecar), validated against the target.
struct DFlashConfig {
    std::filesystem::path config_path;
    int64_t vocab_size = 0;  // the target's
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;
    int n_q_heads = 0, n_kv_heads = 0, head_dim = 0;
    int rotary_dim = 0;
    float rope_theta = 1e6f;
    float rms_norm_eps = 1e-6f;
    int block_size = 0;                    // tokens per block, anchor included
    std::vector<int> target_layer_ids;     // z-lab convention (output of layer id)
    int64_t target_hidden_size = 0;        // width of each tapped feature
    int32_t mask_token_id = -1;            // -1: none (only allowed with a sidecar)
    std::vector<DFlashLayerAttention> layers;
    bool sinks = false;                    // per-head attention sink on every layer
    float value_scale = 1.f;               // V multiplied by this before caching
    std::vector<float> mask_embedding;     // [hidden] from the sidecar; empty: embed(mask_token_id)
    std::filesystem::path mask_embedding_file;
};

// Parses config.json of the drafter checkpoint (opened with or without weights) and checks it
// against the target: hidden and vocab sizes, target_layer_ids < the target's layers,
// num_target_layers, mask_token_id < vocab. `load_sidecar` reads the mask-embedding sidecar.
// Throws naming the file and the field, with expected and actual values.
DFlashConfig read_dflash_config(const Checkpoint& checkpoint, const ModelConfig& target, bool load_sidecar = true);

// Pages of the drafter's KV pool: max_num_seqs sequences of max_model_len tokens plus one block,
// except that sliding-window groups hold only each sequence's last window plus one step's rows
// when max_num_batched_tokens (> 0) bounds a step. Shared with the memory plan.
constexpr int kDFlashMinTokensPerPage = 16;  // the drafter's KV page geometry (make_kv_layout)
int64_t dflash_kv_pages(const KvLayout& layout, int64_t max_num_seqs, int64_t max_model_len, int block_size,
                        int64_t max_num_batched_tokens);

// The sidecar of `dir` as [hidden] floats; empty if the directory has none.
std::vector<float> read_mask_embedding_sidecar(const std::filesystem::path& dir, int64_t hidden,
                                               std::filesystem::path* found = nullptr);

class DFlashDrafter final : public Drafter {
public:
    DFlashDrafter(const SpeculativeConfig& spec, const DrafterContext& context);
    ~DFlashDrafter() override;

    const char* method() const override { return "dflash"; }
    int num_speculative_tokens() const override { return num_speculative_tokens_; }
    std::vector<int> feature_layers() const override { return config_.target_layer_ids; }
    void observe(const TargetHidden& hidden) override;
    std::vector<std::vector<int32_t>> propose(std::span<const DraftRequest> requests) override;
    void release(int seq) override;
    // All-sliding drafters (MiMo's use_swa): the widest window; any full-attention layer: -1.
    int64_t context_window() const override;
    int64_t prefix_cache_block() const override;

    const DFlashConfig& config() const { return config_; }
    const KvCacheManager& kv() const { return *kv_; }
    size_t pool_bytes() const { return pool_.bytes(); }
    // Context tokens injected for `seq` (-1: unknown; -2: lost, i.e. it gets no drafts).
    int64_t context_length(int seq) const;
    // Keep the logits of every propose() on the host (numerics tests): proposals then come from a
    // host argmax over [rows, vocab] instead of the device argmax that downloads only the ids.
    void keep_logits(bool keep) { keep_logits_ = keep; }
    // Logits [rows, vocab] of the last propose() with keep_logits, rows = the drafted slots of
    // every request in order.
    const std::vector<float>& last_logits() const { return last_logits_; }

private:
    struct LayerWeights {
        Tensor input_norm, post_attn_norm;  // [hidden] f32
        Tensor q_proj;                      // [n_q * head_dim, hidden]
        Tensor k_proj, v_proj;              // [n_kv * head_dim, hidden]
        Tensor o_proj;                      // [hidden, n_q * head_dim]
        Tensor q_norm, k_norm;              // [head_dim] f32
        Tensor sinks;                       // [n_q] f32 (sink checkpoints only)
        Tensor gate_up;                     // [2 * intermediate, hidden]: gate rows then up rows
        Tensor down;                        // [hidden, intermediate]
    };
    struct SequenceState {
        int64_t context = 0;  // tokens [0, context) are injected
        bool lost = false;    // an observation gap: no drafts until release
    };

    void load_weights(Checkpoint* checkpoint);
    Tensor load(Checkpoint* checkpoint, const std::string& name, std::initializer_list<int64_t> shape, bool keep_f32);
    Tensor allocate(DType dtype, std::initializer_list<int64_t> shape);
    void fill_dummy(const Tensor& t, bool is_norm);
    void build_kv(const DrafterContext& context);
    void build_mask_row();
    Tensor upload_i32(std::vector<int32_t> host, std::initializer_list<int64_t> dims);
    // Per KV group: metadata for `rows` new tokens (seq, position) and attention over kv_lens.
    struct RowRef {
        int seq;
        int64_t position;
    };
    std::vector<AttentionBatch> make_batches(const std::vector<RowRef>& rows, const std::vector<int>& seqs,
                                             const std::vector<int32_t>& cu_q_lens, const std::vector<int32_t>& kv_lens,
                                             const Tensor& positions);

    DFlashConfig config_;
    Model& target_;
    Backend& backend_;
    bool dummy_;
    int num_speculative_tokens_ = 0;
    DType act_;  // activations and KV cache: the target's activation dtype
    uint64_t dummy_counter_ = 0;

    std::vector<Buffer> buffers_;  // owns every weight
    Tensor fc_;                    // [hidden, n_features * target_hidden]
    Tensor hidden_norm_, norm_;    // [hidden] f32
    Tensor embed_;                 // [vocab, hidden]: own or the target's
    Tensor lm_head_;               // [vocab, hidden]: own or the target's
    Tensor mask_row_;              // [1, hidden] act: the MASK slots' input embedding
    std::vector<LayerWeights> layers_;

    std::unique_ptr<KvCacheManager> kv_;
    Buffer pool_;
    std::vector<LayerCache> caches_;  // [n_layers] page-strided views into pool_
    std::vector<int> layer_group_;    // [n_layers]
    std::unordered_map<int, SequenceState> sequences_;

    Workspace workspace_;
    std::vector<std::vector<int32_t>> host_metadata_;  // kept until the step's synchronize
    std::vector<float> last_logits_;
    bool keep_logits_ = false;
};

}  // namespace xinfer
