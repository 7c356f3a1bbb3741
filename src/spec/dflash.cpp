// DFlash drafter: weights, its own paged KV cache, context injection and the block forward.
// The design and conventions are in dflash.h; config parsing in dflash_config.cpp.
#include "spec/dflash.h"
#include "models/dummy_weights.h"

#include "core/status.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace xinfer {

DFlashDrafter::DFlashDrafter(const SpeculativeConfig& spec, const DrafterContext& context)
    : target_(context.target),
      backend_(context.backend),
      dummy_(context.dummy_weights),
      act_(context.target.activation_dtype()),
      workspace_(context.backend) {
    if (spec.model.empty()) fail("--speculative-config: method \"dflash\" needs \"model\": the drafter's directory");
    std::unique_ptr<Checkpoint> checkpoint = Checkpoint::open(spec.model, /*load_weights=*/!dummy_);
    config_ = read_dflash_config(*checkpoint, target_.config(), /*load_sidecar=*/!dummy_);
    const int max_drafts = config_.block_size - 1;
    num_speculative_tokens_ = spec.num_speculative_tokens > 0 ? spec.num_speculative_tokens : max_drafts;
    if (num_speculative_tokens_ > max_drafts)
        fail("--speculative-config: num_speculative_tokens {} exceeds block_size - 1 = {} of the drafter ({})",
             num_speculative_tokens_, max_drafts, config_.config_path.string());
    load_weights(dummy_ ? nullptr : checkpoint.get());
    build_kv(context);
    build_mask_row();
}

DFlashDrafter::~DFlashDrafter() = default;

// ---- weights ----------------------------------------------------------------------------

Tensor DFlashDrafter::allocate(DType dtype, std::initializer_list<int64_t> shape) {
    Tensor t(nullptr, dtype, shape);
    Buffer buffer = backend_.alloc(std::max<size_t>(t.nbytes(), 1));
    t.data = buffer.data();
    buffers_.push_back(std::move(buffer));
    return t;
}

// The decoder's dummy weights (src/models/dummy_weights.h), deterministic in load order.
void DFlashDrafter::fill_dummy(const Tensor& t, bool is_norm) {
    const uint64_t stream = 0x5eed0d4a5ull * 0x9e3779b97f4a7c15ull + (++dummy_counter_) * 0xbf58476d1ce4e5b9ull;
    fill_dummy_weights(backend_, t, is_norm, stream);
}

// Matrices in the activation dtype (f32 on the CPU oracle), norms and sinks in f32.
Tensor DFlashDrafter::load(Checkpoint* checkpoint, const std::string& name, std::initializer_list<int64_t> shape,
                           bool keep_f32) {
    Tensor t = allocate(keep_f32 ? DType::f32 : act_, shape);
    if (!checkpoint) {
        fill_dummy(t, name.ends_with("norm.weight"));
        return t;
    }
    std::vector<uint8_t> host(t.nbytes());
    checkpoint->read(name, std::span<const int64_t>(shape.begin(), shape.size()), t.dtype, host.data());
    backend_.upload(t, host.data());
    backend_.synchronize();  // `host` dies here
    return t;
}

void DFlashDrafter::load_weights(Checkpoint* checkpoint) {
    const DFlashConfig& c = config_;
    const int64_t hidden = c.hidden_size, inter = c.intermediate_size, vocab = c.vocab_size;
    const int64_t features = int64_t(c.target_layer_ids.size()) * c.target_hidden_size;
    const int64_t n_q = c.n_q_heads, n_kv = c.n_kv_heads, d = c.head_dim;
    // z-lab checkpoints name tensors from the draft model itself ("fc.weight"); exports of a
    // wrapper carry "model.".
    std::string p;
    if (checkpoint && !checkpoint->has("fc.weight") && checkpoint->has("model.fc.weight")) p = "model.";
    if (checkpoint) {
        for (const std::string& name : {std::string("d2t"), p + "d2t"})
            if (checkpoint->has(name))
                fail("{}: tensor {}: reduced draft vocabularies (d2t) are not supported", checkpoint->dir().string(),
                     name);
        checkpoint->skip_prefix(p + "t2d");  // the inverse map; unused without d2t
    }

    fc_ = load(checkpoint, p + "fc.weight", {hidden, features}, false);
    hidden_norm_ = load(checkpoint, p + "hidden_norm.weight", {hidden}, true);
    norm_ = load(checkpoint, p + "norm.weight", {hidden}, true);
    layers_.resize(c.layers.size());
    for (size_t i = 0; i < c.layers.size(); ++i) {
        LayerWeights& w = layers_[i];
        const std::string l = p + "layers." + std::to_string(i) + ".";
        w.input_norm = load(checkpoint, l + "input_layernorm.weight", {hidden}, true);
        w.post_attn_norm = load(checkpoint, l + "post_attention_layernorm.weight", {hidden}, true);
        w.q_proj = load(checkpoint, l + "self_attn.q_proj.weight", {n_q * d, hidden}, false);
        w.k_proj = load(checkpoint, l + "self_attn.k_proj.weight", {n_kv * d, hidden}, false);
        w.v_proj = load(checkpoint, l + "self_attn.v_proj.weight", {n_kv * d, hidden}, false);
        w.o_proj = load(checkpoint, l + "self_attn.o_proj.weight", {hidden, n_q * d}, false);
        w.q_norm = load(checkpoint, l + "self_attn.q_norm.weight", {d}, true);
        w.k_norm = load(checkpoint, l + "self_attn.k_norm.weight", {d}, true);
        if (c.sinks) {
            // MiMo / vLLM name: attention_sink_bias; transformers-native exports: sinks.
            const std::string hub = l + "self_attn.attention_sink_bias";
            const bool use_hub = !checkpoint || checkpoint->has(hub) || !checkpoint->has(l + "self_attn.sinks");
            w.sinks = load(checkpoint, use_hub ? hub : l + "self_attn.sinks", {n_q}, true);
        }
        if (!checkpoint) {
            w.gate_up = load(nullptr, l + "mlp.gate_up", {2 * inter, hidden}, false);
        } else {
            w.gate_up = allocate(act_, {2 * inter, hidden});
            std::vector<uint8_t> host(w.gate_up.nbytes());
            checkpoint->read(l + "mlp.gate_proj.weight", {inter, hidden}, act_, host.data());
            checkpoint->read(l + "mlp.up_proj.weight", {inter, hidden}, act_, host.data() + host.size() / 2);
            backend_.upload(w.gate_up, host.data());
            backend_.synchronize();
        }
        w.down = load(checkpoint, l + "mlp.down_proj.weight", {hidden, inter}, false);
    }

    // The target's vocabulary projections unless the drafter ships its own.
    const std::string own_embedding = p + "embed_tokens.weight";
    if (checkpoint && checkpoint->has(own_embedding)) {
        embed_ = load(checkpoint, own_embedding, {vocab, hidden}, false);
    } else {
        embed_ = target_.token_embedding();
        if (embed_.cols() != hidden)
            fail("{}: the drafter's hidden_size {} differs from the target embedding's width {} and the drafter ships "
                 "no {}",
                 c.config_path.string(), hidden, embed_.cols(), own_embedding);
    }
    std::string own_head = checkpoint && checkpoint->has("lm_head.weight") ? "lm_head.weight" : p + "lm_head.weight";
    if (checkpoint && checkpoint->has(own_head)) {
        lm_head_ = load(checkpoint, own_head, {vocab, hidden}, false);
    } else {
        lm_head_ = target_.lm_head();
        if (lm_head_.cols() != hidden)
            fail("{}: the drafter's hidden_size {} differs from the target lm_head's width {} and the drafter ships "
                 "no lm_head.weight",
                 c.config_path.string(), hidden, lm_head_.cols());
    }
    if (checkpoint) checkpoint->finish();
}

// The MASK slots' input: the sidecar when present, else embed(mask_token_id), computed once
// (the table is frozen) so every block needs just one row copy.
void DFlashDrafter::build_mask_row() {
    mask_row_ = allocate(act_, {1, config_.hidden_size});
    if (!config_.mask_embedding.empty()) {
        std::vector<uint8_t> host(mask_row_.nbytes());
        convert_from_f32(config_.mask_embedding.data(), act_, host.data(), config_.hidden_size);
        backend_.upload(mask_row_, host.data());
        backend_.synchronize();
        return;
    }
    workspace_.reset();
    host_metadata_.clear();
    Tensor id = upload_i32({config_.mask_token_id}, {1});
    backend_.embedding(embed_, id, mask_row_);
    backend_.synchronize();
}

// ---- KV cache -----------------------------------------------------------------------------

// One pool of equal-byte pages over the drafter's layer groups (full, and one per window),
// page-strided views per layer exactly as the Runner builds them (src/runtime/runner.cpp).
// Capacity: dflash_kv_pages().
int64_t dflash_kv_pages(const KvLayout& layout, int64_t max_num_seqs, int64_t max_model_len, int block_size,
                        int64_t max_num_batched_tokens) {
    int64_t n_pages = 0;
    for (size_t g = 0; g < layout.groups.size(); ++g) {
        const KvGroupLayout& group = layout.groups[g];
        const int64_t whole = max_num_seqs * layout.pages_for(int(g), max_model_len + block_size);
        if (!group.sliding || max_num_batched_tokens <= 0) {
            n_pages += whole;
            continue;
        }
        // A sliding group keeps each sequence's last window (the manager releases older pages as
        // the context is committed), but rows are injected before that release: one step's
        // committed rows (≤ the token budget) plus, per sequence, the window, one block and the
        // two partial pages at its ends.
        const int64_t per_page = group.tokens_per_page;
        const int64_t per_seq = (group.window - 1 + block_size + per_page - 1) / per_page + 2;
        const int64_t bounded = max_num_seqs * (per_seq + 1) + (max_num_batched_tokens + per_page - 1) / per_page;
        n_pages += std::min(whole, bounded);
    }
    return n_pages;
}

void DFlashDrafter::build_kv(const DrafterContext& context) {
    const size_t n_layers = config_.layers.size();
    std::vector<KvGroupShape> shapes;
    for (size_t i = 0; i < n_layers; ++i) {
        const int window = config_.layers[i].window;
        auto it = std::find_if(shapes.begin(), shapes.end(), [&](const KvGroupShape& s) { return s.window == window; });
        if (it == shapes.end()) {
            shapes.push_back({window > 0, window, config_.n_kv_heads, config_.head_dim, config_.head_dim, {}});
            it = shapes.end() - 1;
        }
        it->layers.push_back(int(i));
    }
    KvLayout layout = make_kv_layout(shapes, act_, kDFlashMinTokensPerPage);
    const int64_t max_model_len =
        context.max_model_len > 0 ? context.max_model_len : target_.config().max_position_embeddings;
    XINFER_CHECK(max_model_len > 0, "DFlash drafter: max_model_len {} must be positive", max_model_len);
    const int64_t n_pages = dflash_kv_pages(layout, std::max(1, context.max_num_seqs), max_model_len,
                                            config_.block_size, context.max_num_batched_tokens);
    // A drafter with full-attention layers needs every position of a sequence's context, so it
    // keeps its own prefix cache: a request the target serves from its cache finds the drafter's
    // K/V of that prefix here (a sliding drafter recomputes its window instead).
    kv_ = std::make_unique<KvCacheManager>(std::move(layout), n_pages, /*enable_prefix_caching=*/context_window() < 0);

    const KvLayout& kv_layout = kv_->layout();
    pool_ = backend_.alloc(size_t(n_pages * kv_layout.page_bytes));
    caches_.resize(n_layers);
    layer_group_.assign(n_layers, -1);
    char* base = static_cast<char*>(pool_.data());
    const int64_t element = int64_t(dtype_size(kv_layout.dtype));
    for (size_t g = 0; g < kv_layout.groups.size(); ++g) {
        const KvGroupLayout& group = kv_layout.groups[g];
        for (size_t i = 0; i < group.layers.size(); ++i) {
            const size_t layer = size_t(group.layers[i]);
            layer_group_[layer] = int(g);
            caches_[layer].k = Tensor(base + group.k_offset[i] * element, kv_layout.dtype,
                                      {n_pages, group.tokens_per_page, group.n_kv_heads, group.head_dim_k});
            caches_[layer].v = Tensor(base + group.v_offset[i] * element, kv_layout.dtype,
                                      {n_pages, group.tokens_per_page, group.n_kv_heads, group.head_dim_v});
        }
    }
}

Tensor DFlashDrafter::upload_i32(std::vector<int32_t> host, std::initializer_list<int64_t> dims) {
    Tensor t = workspace_.make(DType::i32, dims);
    host_metadata_.push_back(std::move(host));  // a moved vector keeps its buffer: the pointer stays valid
    backend_.upload(t, host_metadata_.back().data());
    return t;
}

std::vector<AttentionBatch> DFlashDrafter::make_batches(const std::vector<RowRef>& rows, const std::vector<int>& seqs,
                                                        const std::vector<int32_t>& cu_q_lens,
                                                        const std::vector<int32_t>& kv_lens, const Tensor& positions) {
    const KvLayout& layout = kv_->layout();
    const int n_seqs = int(seqs.size());
    const int64_t n_rows = int64_t(rows.size());
    Tensor cu = upload_i32(cu_q_lens, {n_seqs + 1});
    Tensor lens = upload_i32(kv_lens, {n_seqs});
    std::vector<AttentionBatch> batches;
    for (size_t g = 0; g < layout.groups.size(); ++g) {
        const int64_t per_page = layout.groups[g].tokens_per_page;
        size_t max_pages = 1;
        for (int seq : seqs) max_pages = std::max(max_pages, kv_->page_table(seq, int(g)).size());
        std::vector<int32_t> table(size_t(n_seqs) * max_pages, -1), slots;
        for (size_t s = 0; s < seqs.size(); ++s) {
            const std::vector<int32_t>& pages = kv_->page_table(seqs[s], int(g));
            std::copy(pages.begin(), pages.end(), table.begin() + long(s * max_pages));
        }
        slots.reserve(rows.size());
        for (const RowRef& row : rows) {
            const int32_t page = kv_->page_table(row.seq, int(g))[size_t(row.position / per_page)];
            XINFER_CHECK(page >= 0, "DFlash drafter: sequence {} group {}: position {} lies on a released page",
                         row.seq, g, row.position);
            slots.push_back(int32_t(page * per_page + row.position % per_page));
        }
        AttentionBatch batch;
        batch.n_seqs = n_seqs;
        batch.max_pages_per_seq = int(max_pages);
        batch.cu_q_lens = cu;
        batch.kv_lens = lens;
        batch.positions = positions;
        batch.page_table = upload_i32(std::move(table), {n_seqs, int64_t(max_pages)});
        batch.slot_mapping = upload_i32(std::move(slots), {n_rows});
        batch.page_stride = layout.page_elements();
        batches.push_back(batch);
    }
    return batches;
}

// ---- the drafter interface --------------------------------------------------------------

void DFlashDrafter::observe(const TargetHidden& hidden) {
    const DFlashConfig& c = config_;
    const int64_t features = int64_t(c.target_layer_ids.size()) * c.target_hidden_size;
    std::vector<int32_t> row_ids, positions, cu_q_lens{0}, kv_lens;
    std::vector<RowRef> rows;
    std::vector<int> seqs;
    struct Commit {
        int seq;
        std::span<const int32_t> tokens;
        int64_t end;
    };
    std::vector<Commit> commits;
    for (const TargetHidden::Sequence& s : hidden.sequences) {
        if (s.n_committed <= 0) continue;
        auto [it, inserted] = sequences_.try_emplace(s.seq);
        SequenceState& state = it->second;
        if (inserted) {
            // Started mid-context: restore [0, start) from the drafter's prefix cache if it has
            // exactly that (the scheduler aligned the target's hit to prefix_cache_block()).
            const bool restore = kv_->prefix_caching() && s.start_position > 0 &&
                                 int64_t(s.tokens.size()) > s.start_position;
            const int64_t restored =
                kv_->add_sequence(s.seq, restore ? s.tokens.first(size_t(s.start_position) + 1) : s.tokens.first(0));
            if (restored == s.start_position) state.context = restored;
        }
        if (state.lost) continue;
        const int64_t end = s.start_position + s.n_committed;
        // First observation mid-context: the positions before it are outside every window the
        // drafter will query (the scheduler kept context_window() positions out of the cache hit).
        if (inserted && s.start_position > 0 && context_window() > 0) state.context = s.start_position;
        if (s.start_position > state.context) {
            // Positions [context, start) were never observed (e.g. served from the target's
            // prefix cache): the context would have a hole, so this sequence drafts no more.
            state.lost = true;
            continue;
        }
        if (end <= state.context) continue;  // already injected
        if (!kv_->allocate(s.seq, end)) {
            state.lost = true;  // pool sized for max_num_seqs × max_model_len: only a caller bug gets here
            continue;
        }
        for (int64_t i = state.context - s.start_position; i < s.n_committed; ++i) {
            row_ids.push_back(int32_t(s.first_row + i));
            positions.push_back(int32_t(s.start_position + i));
            rows.push_back({s.seq, s.start_position + i});
        }
        seqs.push_back(s.seq);
        cu_q_lens.push_back(int32_t(row_ids.size()));
        kv_lens.push_back(int32_t(end));
        commits.push_back({s.seq, s.tokens, end});
        state.context = end;
    }
    if (row_ids.empty()) return;
    if (hidden.features.cols() != features)
        fail("DFlash drafter: target features are {} wide, expected {} ({} layers × hidden {})", hidden.features.cols(),
             features, c.target_layer_ids.size(), c.target_hidden_size);
    for (int32_t row : row_ids)
        XINFER_CHECK(row >= 0 && row < hidden.features.rows(), "feature row {} outside the {} rows of the forward", row,
                     hidden.features.rows());

    workspace_.reset();
    host_metadata_.clear();
    const int64_t n = int64_t(row_ids.size()), hidden_size = c.hidden_size, n_kv = c.n_kv_heads, d = c.head_dim;
    Tensor ids = upload_i32(std::move(row_ids), {n});
    check_tokens_are_newest_keys(cu_q_lens, kv_lens, positions);
    Tensor pos = upload_i32(std::move(positions), {n});
    const std::vector<AttentionBatch> batches = make_batches(rows, seqs, cu_q_lens, kv_lens, pos);

    // ctx = hidden_norm(fc(features of the committed rows)), shared by every layer.
    Tensor gathered = workspace_.make(act_, {n, features});  // [n, n_features * target_hidden]
    backend_.embedding(hidden.features, ids, gathered);      // row gather
    Tensor fused = workspace_.make(act_, {n, hidden_size});  // [n, hidden]
    backend_.matmul(gathered, fc_, fused);
    Tensor ctx = workspace_.make(act_, {n, hidden_size});  // [n, hidden]
    backend_.rmsnorm(fused, hidden_norm_, c.rms_norm_eps, ctx);
    const RopeParams rope{c.rotary_dim, c.rope_theta};
    for (size_t il = 0; il < layers_.size(); ++il) {
        const LayerWeights& w = layers_[il];
        backend_.set_layer(int(il));
        Tensor k = workspace_.make(act_, {n, n_kv, d});  // [n, n_kv, head_dim]
        Tensor v = workspace_.make(act_, {n, n_kv, d});  // [n, n_kv, head_dim]
        backend_.matmul(ctx, w.k_proj, k.reshape({n, n_kv * d}));
        backend_.matmul(ctx, w.v_proj, v.reshape({n, n_kv * d}));
        backend_.rmsnorm(k.reshape({n * n_kv, d}), w.k_norm, c.rms_norm_eps, k.reshape({n * n_kv, d}));
        backend_.rope(k, pos, rope);
        if (c.value_scale != 1.f) backend_.scale(v, c.value_scale);
        backend_.kv_store(k, v, caches_[il].k, caches_[il].v, batches[size_t(layer_group_[il])]);
    }
    backend_.set_layer(-1);
    backend_.synchronize();

    // KvCacheManager::commit hashes the tokens for the prefix cache. Without one (sliding
    // drafters) a placeholder stands in for tokens a test's TargetHidden left out; with one,
    // only positions whose tokens are known are committed (and so registered).
    std::vector<int32_t> placeholder;
    for (const Commit& commit : commits) {
        std::span<const int32_t> tokens = commit.tokens;
        int64_t end = commit.end;
        if (int64_t(tokens.size()) < end) {
            if (kv_->prefix_caching()) {
                end = int64_t(tokens.size());
            } else {
                placeholder.assign(size_t(end), 0);
                tokens = placeholder;
            }
        }
        kv_->commit(commit.seq, tokens, end);
    }
}

std::vector<std::vector<int32_t>> DFlashDrafter::propose(std::span<const DraftRequest> requests) {
    const DFlashConfig& c = config_;
    std::vector<std::vector<int32_t>> drafts(requests.size());
    struct Active {
        size_t request;
        int seq;
        int64_t anchor_position;
        int32_t anchor;
        int n_drafts;
    };
    std::vector<Active> active;
    const int block = c.block_size;
    for (size_t r = 0; r < requests.size(); ++r) {
        const DraftRequest& request = requests[r];
        const int n_drafts = std::min({request.max_drafts, num_speculative_tokens_, block - 1});
        if (n_drafts <= 0 || request.tokens.empty()) continue;
        auto it = sequences_.find(request.seq);
        if (it == sequences_.end() || it->second.lost) continue;
        const int64_t anchor_position = int64_t(request.tokens.size()) - 1;
        // The context must be exactly the tokens before the anchor (research §8.2).
        if (it->second.context != anchor_position) continue;
        if (!kv_->allocate(request.seq, anchor_position + block)) continue;
        active.push_back({r, request.seq, anchor_position, request.tokens.back(), n_drafts});
    }
    last_logits_.clear();
    if (active.empty()) return drafts;

    workspace_.reset();
    host_metadata_.clear();
    const int64_t n_active = int64_t(active.size()), n_tokens = n_active * block;
    const int64_t hidden = c.hidden_size, n_q = c.n_q_heads, n_kv = c.n_kv_heads, d = c.head_dim;
    const int64_t inter = c.intermediate_size, vocab = c.vocab_size;
    std::vector<int32_t> anchors, gather, positions, cu_q_lens{0}, kv_lens, out_rows;
    std::vector<RowRef> rows;
    std::vector<int> seqs;
    for (int64_t a = 0; a < n_active; ++a) {
        const Active& x = active[size_t(a)];
        anchors.push_back(x.anchor);
        for (int i = 0; i < block; ++i) {
            gather.push_back(int32_t(i == 0 ? a : n_active));  // slot 0: its anchor row; others: the MASK row
            positions.push_back(int32_t(x.anchor_position + i));
            rows.push_back({x.seq, x.anchor_position + i});
        }
        for (int i = 1; i <= x.n_drafts; ++i) out_rows.push_back(int32_t(a * block + i));
        seqs.push_back(x.seq);
        cu_q_lens.push_back(int32_t((a + 1) * block));
        kv_lens.push_back(int32_t(x.anchor_position + block));
    }
    const int64_t n_out = int64_t(out_rows.size());
    Tensor anchor_ids = upload_i32(std::move(anchors), {n_active});
    Tensor gather_ids = upload_i32(std::move(gather), {n_tokens});
    check_tokens_are_newest_keys(cu_q_lens, kv_lens, positions);
    Tensor pos = upload_i32(std::move(positions), {n_tokens});
    Tensor out_ids = upload_i32(std::move(out_rows), {n_out});
    const std::vector<AttentionBatch> batches = make_batches(rows, seqs, cu_q_lens, kv_lens, pos);

    // Block input: [anchor embeddings; MASK row] gathered into [anchor, MASK × (B-1)] per request.
    Tensor sources = workspace_.make(act_, {n_active + 1, hidden});  // [n_active + 1, hidden]
    backend_.embedding(embed_, anchor_ids, sources.slice(0, n_active));
    backend_.copy(sources.slice(n_active, 1), mask_row_);
    Tensor residual = workspace_.make(act_, {n_tokens, hidden});   // [n_tokens, hidden] the residual stream
    Tensor normed = workspace_.make(act_, {n_tokens, hidden});     // [n_tokens, hidden]
    Tensor block_out = workspace_.make(act_, {n_tokens, hidden});  // [n_tokens, hidden] last block's output
    backend_.embedding(sources, gather_ids, residual);

    const RopeParams rope{c.rotary_dim, c.rope_theta};
    const float eps = c.rms_norm_eps;
    for (size_t il = 0; il < layers_.size(); ++il) {
        const LayerWeights& w = layers_[il];
        const DFlashLayerAttention& kind = c.layers[il];
        backend_.set_layer(int(il));
        if (il == 0) backend_.rmsnorm(residual, w.input_norm, eps, normed);
        else backend_.add_rmsnorm(residual, block_out, w.input_norm, eps, normed);

        Tensor q = workspace_.make(act_, {n_tokens, n_q, d});   // [n_tokens, n_q, head_dim]
        Tensor k = workspace_.make(act_, {n_tokens, n_kv, d});  // [n_tokens, n_kv, head_dim]
        Tensor v = workspace_.make(act_, {n_tokens, n_kv, d});  // [n_tokens, n_kv, head_dim]
        backend_.matmul(normed, w.q_proj, q.reshape({n_tokens, n_q * d}));
        backend_.matmul(normed, w.k_proj, k.reshape({n_tokens, n_kv * d}));
        backend_.matmul(normed, w.v_proj, v.reshape({n_tokens, n_kv * d}));
        backend_.rmsnorm(q.reshape({n_tokens * n_q, d}), w.q_norm, eps, q.reshape({n_tokens * n_q, d}));
        backend_.rmsnorm(k.reshape({n_tokens * n_kv, d}), w.k_norm, eps, k.reshape({n_tokens * n_kv, d}));
        // The block's K/V go to its own positions, past the committed context: visible to this
        // forward only, overwritten by the next injection.
        const AttentionBatch& batch = batches[size_t(layer_group_[il])];
        backend_.rope_kv_store(q, k, v, pos, rope, c.value_scale, caches_[il].k, caches_[il].v, batch);
        AttentionParams params;
        params.n_q_heads = c.n_q_heads;
        params.n_kv_heads = c.n_kv_heads;
        params.head_dim_k = c.head_dim;
        params.head_dim_v = c.head_dim;
        params.softmax_scale = float(1.0 / std::sqrt(double(d)));
        params.window = kind.window;
        params.causal = kind.causal;
        params.page_size = int(caches_[il].k.dim(1));
        Tensor attn = workspace_.make(act_, {n_tokens, n_q, d});  // [n_tokens, n_q, head_dim]
        backend_.attention(q, caches_[il].k, caches_[il].v, w.sinks, batch, params, attn);
        backend_.matmul(attn.reshape({n_tokens, n_q * d}), w.o_proj, block_out);

        backend_.add_rmsnorm(residual, block_out, w.post_attn_norm, eps, normed);
        Tensor gate_up = workspace_.make(act_, {n_tokens, 2 * inter});  // [n_tokens, 2 * intermediate]
        Tensor activated = workspace_.make(act_, {n_tokens, inter});    // [n_tokens, intermediate]
        backend_.matmul(normed, w.gate_up, gate_up);
        backend_.swiglu(gate_up, activated);
        backend_.matmul(activated, w.down, block_out);
    }
    backend_.add_rmsnorm(residual, block_out, norm_, eps, normed);
    backend_.set_layer(-1);

    Tensor selected = workspace_.make(act_, {n_out, hidden});      // [n_out, hidden] the drafted slots
    backend_.embedding(normed, out_ids, selected);                 // row gather
    Tensor logits = workspace_.make(DType::f32, {n_out, vocab});   // [n_out, vocab]
    backend_.matmul(selected, lm_head_, logits);
    // Greedy proposals: the first maximum of each drafted slot, as torch.argmax.
    std::vector<int32_t> ids(static_cast<size_t>(n_out));
    if (keep_logits_) {
        last_logits_.resize(size_t(n_out * vocab));
        backend_.download(logits, last_logits_.data());
        backend_.synchronize();
        for (int64_t r = 0; r < n_out; ++r) {
            const float* l = last_logits_.data() + r * vocab;
            ids[size_t(r)] = int32_t(std::max_element(l, l + vocab) - l);
        }
    } else {
        Tensor device_ids = workspace_.make(DType::i32, {n_out});  // [n_out]
        backend_.argmax(logits, device_ids);
        backend_.download(device_ids, ids.data());
        backend_.synchronize();
    }
    int64_t row = 0;
    for (const Active& x : active) {
        std::vector<int32_t>& out = drafts[x.request];
        for (int i = 0; i < x.n_drafts; ++i, ++row) out.push_back(ids[size_t(row)]);
    }
    return drafts;
}

int64_t DFlashDrafter::prefix_cache_block() const { return kv_->prefix_caching() ? kv_->layout().block_tokens() : 1; }

int64_t DFlashDrafter::context_window() const {
    int64_t widest = 0;
    for (const DFlashLayerAttention& layer : config_.layers) {
        if (layer.window <= 0) return -1;
        widest = std::max<int64_t>(widest, layer.window);
    }
    return widest;
}

void DFlashDrafter::release(int seq) {
    if (kv_->has_sequence(seq)) kv_->free_sequence(seq);
    sequences_.erase(seq);
}

int64_t DFlashDrafter::context_length(int seq) const {
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) return -1;
    return it->second.lost ? -2 : it->second.context;
}

std::unique_ptr<Drafter> make_dflash_drafter(const SpeculativeConfig& config, const DrafterContext& context) {
    return std::make_unique<DFlashDrafter>(config, context);
}

}  // namespace xinfer
