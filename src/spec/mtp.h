// MiMo-V2-Flash's multi-token-prediction heads as a drafter (speculative method "mtp";
// research/mimo_v2_flash.md §5, §6.3).
//
// Head k (checkpoint prefix `model.mtp.layers.{k}.`) maps an input hidden h and a token t to
//     z   = eh_proj([enorm(embed(t)), hnorm(h)])              (eh_proj [hidden, 2·hidden])
//     x   = z + o_proj(SWA-attention(input_layernorm(z)))     (target's sliding geometry: heads,
//                                                              dims, window, sinks, rope theta,
//                                                              partial rotary, value scale)
//     out = x + down(silu(gate(m)) · up(m)),  m = pre_mlp_layernorm(x)
//     logits = lm_head(final_layernorm(out))                   (the target's lm_head)
// `out` (before final_layernorm) is the hidden the next head chains on.
//
// Positions (vLLM's convention: each chained step advances the position by one):
//     head 0 at q: (h_q, t_{q+1})        → predicts t_{q+2}
//     head k at q: (out^{k-1}_{q-1}, t_{q+1}) → predicts t_{q+2}        (k ≥ 1, q ≥ k)
// so along a chain anchored at the last committed position P (anchor token t_{P+1}):
//     d0 = head 0 at P, d1 = head 1 at P+1 (on out^0_P, d0), d2 = head 2 at P+2 (on out^1_{P+1}, d1) …
//
// KV caches (one paged cache per head, its own KvCacheManager; sliding window = the target's):
//  - observe() runs every head TEACHER-FORCED over every committed position: head 0 on
//    (h_q, t_{q+1}) for all committed q, head k ≥ 1 on (out^{k-1}_{q-1}, t_{q+1}) for committed
//    q ≥ k. So after observing positions 0..P, head k's cache holds positions k..P, computed from
//    committed tokens and target hiddens only. Head k stores position q in cache slot q − k (its
//    first position has no input before it); RoPE uses the absolute position q, and the window
//    mask sees slot distances, which equal position distances.
//  - A sequence first observed at position b > 0 (after a prefix-cache hit) is observed as if it
//    began there: head k starts at position b + k, in slot q − k − b. Head k's row at q is then
//    exact once every key its window reaches is, i.e. for q ≥ b + (k + 1)·(W − 1) with window W,
//    so context_window() asks the scheduler to keep n_heads·W prompt positions out of the hit:
//    the first draft chain then equals a cold run's.
//  - propose() runs head k ≥ 1 over positions P+1..P+k: position P+j on (out^{k-1}_{P+j-1}, d_{j-1})
//    (positions below k skipped: a short prompt's chain still has all k+1 drafts)
//    — out^{k-1}_P from observe, the others from head k−1's own propose rows. These are exactly
//    the rows teacher forcing would compute if the drafts were the committed tokens, so a draft
//    chain never attends to a gap, and d_k is a deterministic function of committed tokens and
//    target hiddens. Those draft rows are rolled back (KvCacheManager::truncate) before propose
//    returns; the next observe recomputes whatever gets committed.
// Cost per committed token: one row through each of the k heads (a dense one-layer block each).
//
// Not thread-safe (the engine loop owns it).
#pragma once

#include "backend/workspace.h"
#include "kv/kv_cache_manager.h"
#include "spec/drafter.h"

#include <memory>
#include <unordered_map>
#include <vector>

namespace xinfer {

class Checkpoint;

// Number of MTP heads `model.mtp.layers.{0..n-1}.` in a checkpoint (counted by eh_proj tensors).
int count_mtp_heads(const Checkpoint& checkpoint);

struct MtpHeadWeights {
    Tensor enorm, hnorm;        // [hidden] f32
    Tensor eh_proj_embed;       // [hidden, hidden]: columns 0..hidden-1 of eh_proj (the embedding half)
    Tensor eh_proj_hidden;      // [hidden, hidden]: columns hidden..2·hidden-1 (the hidden half)
    Tensor input_norm;          // [hidden] f32
    Tensor q_proj;              // [n_q * dk, hidden]
    Tensor k_proj;              // [n_kv * dk, hidden]
    Tensor v_proj;              // [n_kv * dv, hidden]
    Tensor o_proj;              // [hidden, n_q * dv]
    Tensor sinks;               // [n_q] f32 (empty if the target's sliding layers have none)
    Tensor pre_mlp_norm;        // [hidden] f32
    Tensor gate_up;             // [2 * intermediate, hidden]: gate rows then up rows
    Tensor down;                // [hidden, intermediate]
    Tensor final_norm;          // [hidden] f32
};

class MtpDrafter final : public Drafter {
public:
    // Loads heads 0..num_speculative_tokens-1 from context.target_dir (or dummy weights).
    // Throws naming the checkpoint when it has no MTP heads or fewer than asked for.
    MtpDrafter(const SpeculativeConfig& config, const DrafterContext& context);
    ~MtpDrafter() override;

    const char* method() const override { return "mtp"; }
    int num_speculative_tokens() const override { return n_heads_; }
    std::vector<int> feature_layers() const override { return {kFinalNormFeature}; }
    void observe(const TargetHidden& hidden) override;
    std::vector<std::vector<int32_t>> propose(std::span<const DraftRequest> requests) override;
    void release(int seq) override;
    // n_heads · W positions (see "A sequence first observed at position b" above).
    int64_t context_window() const override;

    // Debug/test hook: with a tap set, every head forward also computes logits for ALL its rows
    // and reports them as ("mtp_logits", head, [rows, vocab] f32) from observe() and
    // ("mtp_draft_logits", head, [rows, vocab] f32) from propose(); rows in request/sequence
    // order, positions ascending within a sequence (see the position table above).
    void set_tap(TapFn tap) { tap_ = std::move(tap); }

    // Observe at most this many positions per sequence per head forward: bounds the KV a
    // sequence needs at once to window + this (the manager releases what left the window).
    static constexpr int64_t kMaxRowsPerPass = 256;

private:
    struct SequenceState {
        int slot = 0;          // row in last_hidden_ tables
        int64_t base = 0;      // first observed position (> 0 after a prefix-cache hit)
        int64_t observed = 0;  // positions base..observed-1 went through head 0 (base+k.. through head k)
        int32_t next_draft = -1;  // head 0's argmax at position observed-1
    };
    struct HeadCache {
        std::unique_ptr<KvCacheManager> kv;
        Buffer pool;
        LayerCache cache;  // views into pool (page-strided)
    };
    // One head forward over `rows` rows (sequences back to back, described by the caller).
    struct HeadBatch {
        std::vector<int> seqs;                 // per sequence
        std::vector<int64_t> first_slot;       // per sequence: cache slot of its first row
        std::vector<int64_t> first_position;   // per sequence: position of its first row (RoPE)
        std::vector<int64_t> n_rows;           // per sequence
        std::vector<int32_t> tokens;           // [rows] token at q + 1 of each row
        std::vector<int32_t> source_rows;      // [rows] row of the input-hidden table
        bool all_logits = false;               // logits for every row, else the last of each sequence
    };
    // Runs head `head` on `batch`; input hiddens are rows `batch.source_rows` of `source`
    // ([*, hidden]). Writes the output hiddens into `out` ([rows, hidden]) and returns the argmax
    // token of each requested row ([n_out], computed on the device).
    std::vector<int32_t> run_head(int head, const HeadBatch& batch, const Tensor& source, const Tensor& out,
                                const char* tap_name);
    void observe_pass(const TargetHidden& hidden, const std::vector<size_t>& entries, const std::vector<int64_t>& ends);
    void load_heads(const DrafterContext& context, int n_heads_in_checkpoint);
    Tensor allocate(DType dtype, std::initializer_list<int64_t> shape);
    int take_slot(int seq);
    // Upload of host i32 metadata into the workspace; the host copy lives until the next reset.
    Tensor upload_i32(std::vector<int32_t> host, std::initializer_list<int64_t> dims);
    void reset_workspace();

    Model& target_;
    Backend& backend_;
    std::string target_dir_;
    int n_heads_ = 0;            // heads used = num_speculative_tokens
    int64_t hidden_ = 0, vocab_ = 0, intermediate_ = 0;
    LayerSpec attn_;             // the target's sliding-layer geometry
    float eps_ = 1e-6f, value_scale_ = 1.f;
    DType act_;                  // the target's activation dtype
    int max_seqs_ = 1;
    std::vector<Buffer> weight_buffers_;
    std::vector<MtpHeadWeights> heads_;
    std::vector<HeadCache> caches_;  // [n_heads_]
    std::vector<Tensor> last_hidden_;  // [n_heads_] each [max_seqs_, hidden]: out^k at position observed-1
    std::unordered_map<int, SequenceState> states_;
    std::vector<int> free_slots_;
    Workspace workspace_;
    std::vector<std::vector<int32_t>> host_metadata_;  // kept until the backend synchronizes
    TapFn tap_;
};

}  // namespace xinfer
