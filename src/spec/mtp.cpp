#include "spec/mtp.h"

#include "models/dummy_weights.h"
#include "core/status.h"
#include "loader/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace xinfer {
namespace {

std::string head_prefix(int k) { return "model.mtp.layers." + std::to_string(k) + "."; }

// The target's sliding-layer geometry: MTP blocks are SWA blocks (research §5 step 4).
LayerSpec sliding_spec(const ModelConfig& config, const std::string& dir) {
    for (const LayerSpec& layer : config.layers)
        if (layer.attention == AttentionKind::sliding) return layer;
    fail("speculative method mtp: target {} ({}) has no sliding-window layers; MTP heads use their geometry", dir,
         config.architecture);
}

}  // namespace

int count_mtp_heads(const Checkpoint& checkpoint) {
    int n = 0;
    while (checkpoint.has(head_prefix(n) + "eh_proj.weight")) ++n;
    return n;
}

MtpDrafter::MtpDrafter(const SpeculativeConfig& config, const DrafterContext& context)
    : target_(context.target),
      backend_(context.backend),
      target_dir_(context.target_dir),
      act_(context.target.activation_dtype()),
      max_seqs_(std::max(1, context.max_num_seqs)),
      workspace_(context.backend) {
    const ModelConfig& tc = target_.config();
    hidden_ = tc.hidden_size;
    vocab_ = tc.vocab_size;
    intermediate_ = tc.intermediate_size;
    eps_ = tc.rms_norm_eps;
    value_scale_ = tc.value_scale;
    attn_ = sliding_spec(tc, target_dir_);

    // How many heads the checkpoint has. Dummy weights: config.json's num_nextn_predict_layers
    // if present, else MiMo-V2-Flash's 3 (its config does not declare the count; research §2).
    int available = 0;
    std::unique_ptr<Checkpoint> checkpoint;
    if (context.dummy_weights) {
        std::unique_ptr<Checkpoint> config_only = Checkpoint::open(target_dir_, false);
        const nlohmann::json& json = config_only->config();
        available = json.contains("num_nextn_predict_layers") && json["num_nextn_predict_layers"].is_number_integer()
                        ? json["num_nextn_predict_layers"].get<int>()
                        : 3;
    } else {
        checkpoint = Checkpoint::open(target_dir_, true);
        available = count_mtp_heads(*checkpoint);
    }
    if (available == 0)
        fail("speculative method mtp: target checkpoint {} has no MTP heads (no tensor {}eh_proj.weight); "
             "MTP needs a MiMo-V2-Flash checkpoint that ships model.mtp.layers.*",
             target_dir_, head_prefix(0));
    n_heads_ = config.num_speculative_tokens > 0 ? config.num_speculative_tokens : available;
    if (n_heads_ > available)
        fail("speculative method mtp: num_speculative_tokens {} exceeds the {} MTP head(s) of {} (one head per "
             "drafted token; expected 1..{})",
             n_heads_, available, target_dir_, available);

    // Weights.
    heads_.resize(size_t(n_heads_));
    const bool host = backend_.props().host_memory != 0;
    uint64_t dummy_counter = 0;
    // Resident dtypes as the decoder's (src/models/decoder.cpp): host-memory backends keep
    // f32/bf16/f16 as stored and dequantize FP8 to f32 (exact); accelerators hold the activation dtype.
    auto resident = [&](DType stored) {
        if (!host) return act_;
        return stored == DType::f32 || stored == DType::bf16 || stored == DType::f16 ? stored : DType::f32;
    };
    auto upload = [&](DType dtype, std::initializer_list<int64_t> shape, const void* bytes) {
        Tensor t = allocate(dtype, shape);
        backend_.upload(t, bytes);
        backend_.synchronize();
        return t;
    };
    // Reads one tensor (shape checked by Checkpoint::read, which names file and tensor on error)
    // into host bytes of `dtype`.
    auto read_host = [&](const std::string& name, std::initializer_list<int64_t> shape, DType dtype, bool is_norm) {
        int64_t numel = 1;
        for (int64_t d : shape) numel *= d;
        std::vector<uint8_t> bytes(size_t(numel) * dtype_size(dtype));
        if (!checkpoint) {
            // A different stream than the target's, so heads are not copies of its layers.
            const uint64_t stream = 0x6d74705f64756d79ull + (++dummy_counter) * 0xbf58476d1ce4e5b9ull;
            const std::vector<float> values = dummy_values(numel, *(shape.end() - 1), is_norm, stream);
            convert_from_f32(values.data(), dtype, bytes.data(), numel);
        } else {
            checkpoint->read(name, std::span<const int64_t>(shape.begin(), shape.size()), dtype, bytes.data());
        }
        return bytes;
    };
    auto stored_dtype = [&](const std::string& name) {
        if (!checkpoint) return host ? DType::f32 : act_;
        if (!checkpoint->has(name))
            fail("speculative method mtp: tensor {} not found in {}", name, target_dir_);
        return checkpoint->info(name).dtype;
    };
    auto load = [&](const std::string& name, std::initializer_list<int64_t> shape) {
        const DType dtype = resident(stored_dtype(name));
        return upload(dtype, shape, read_host(name, shape, dtype, false).data());
    };
    auto load_f32 = [&](const std::string& name, std::initializer_list<int64_t> shape, bool is_norm) {
        return upload(DType::f32, shape, read_host(name, shape, DType::f32, is_norm).data());
    };

    const int64_t H = hidden_, n_q = attn_.n_q_heads, n_kv = attn_.n_kv_heads, dk = attn_.head_dim_k,
                  dv = attn_.head_dim_v, I = intermediate_;
    for (int k = 0; k < n_heads_; ++k) {
        const std::string p = head_prefix(k);
        MtpHeadWeights& w = heads_[size_t(k)];
        w.enorm = load_f32(p + "enorm.weight", {H}, true);
        w.hnorm = load_f32(p + "hnorm.weight", {H}, true);
        {
            // eh_proj [H, 2H] acts on concat([enorm(e), hnorm(h)]): split its columns so the two
            // halves are two matmuls (no concat op needed): z = enorm(e)·W_eᵀ + hnorm(h)·W_hᵀ.
            const DType dtype = resident(stored_dtype(p + "eh_proj.weight"));
            const std::vector<uint8_t> full = read_host(p + "eh_proj.weight", {H, 2 * H}, dtype, false);
            const size_t half_row = size_t(H) * dtype_size(dtype);
            std::vector<uint8_t> embed_half(size_t(H) * half_row), hidden_half(size_t(H) * half_row);
            for (int64_t r = 0; r < H; ++r) {
                std::memcpy(embed_half.data() + size_t(r) * half_row, full.data() + size_t(r) * 2 * half_row, half_row);
                std::memcpy(hidden_half.data() + size_t(r) * half_row,
                            full.data() + size_t(r) * 2 * half_row + half_row, half_row);
            }
            w.eh_proj_embed = upload(dtype, {H, H}, embed_half.data());
            w.eh_proj_hidden = upload(dtype, {H, H}, hidden_half.data());
        }
        w.input_norm = load_f32(p + "input_layernorm.weight", {H}, true);
        w.q_proj = load(p + "self_attn.q_proj.weight", {n_q * dk, H});
        w.k_proj = load(p + "self_attn.k_proj.weight", {n_kv * dk, H});
        w.v_proj = load(p + "self_attn.v_proj.weight", {n_kv * dv, H});
        w.o_proj = load(p + "self_attn.o_proj.weight", {H, n_q * dv});
        if (attn_.has_sinks) {
            // Hub checkpoints name it attention_sink_bias, transformers-native ones sinks.
            const std::string hub = p + "self_attn.attention_sink_bias";
            w.sinks = load_f32(!checkpoint || checkpoint->has(hub) ? hub : p + "self_attn.sinks", {n_q}, false);
        }
        w.pre_mlp_norm = load_f32(p + "pre_mlp_layernorm.weight", {H}, true);
        {
            const DType dtype = resident(stored_dtype(p + "mlp.gate_proj.weight"));
            std::vector<uint8_t> gate_up = read_host(p + "mlp.gate_proj.weight", {I, H}, dtype, false);
            const std::vector<uint8_t> up = read_host(p + "mlp.up_proj.weight", {I, H}, dtype, false);
            gate_up.insert(gate_up.end(), up.begin(), up.end());
            w.gate_up = upload(dtype, {2 * I, H}, gate_up.data());
        }
        w.down = load(p + "mlp.down_proj.weight", {H, I});
        w.final_norm = load_f32(p + "final_layernorm.weight", {H}, true);
    }
    if (checkpoint) {
        // Strict: every tensor of the heads we use must have been read (a leftover under their
        // prefixes is a misnamed or unexpected tensor). The decoder owns everything else.
        for (const char* prefix : {"model.layers.", "model.embed_tokens.", "model.norm.", "lm_head."})
            checkpoint->skip_prefix(prefix);
        for (int k = n_heads_; k < available; ++k) checkpoint->skip_prefix(head_prefix(k));
        checkpoint->finish();
    }

    // One paged cache per head: a single sliding group of one layer, its own manager and pool.
    // Per sequence a head holds at most window − 1 keys behind the next query plus one observe
    // pass (kMaxRowsPerPass) or one draft chain (n_heads) ahead; +2 pages for misalignment.
    const DType kv_dtype = act_;
    const int64_t live_tokens = int64_t(attn_.window) + std::max<int64_t>(kMaxRowsPerPass, n_heads_);
    for (int k = 0; k < n_heads_; ++k) {
        KvGroupShape shape{true, attn_.window, attn_.n_kv_heads, attn_.head_dim_k, attn_.head_dim_v, {0}};
        KvLayout layout = make_kv_layout({shape}, kv_dtype, 16);
        const KvGroupLayout& group = layout.groups[0];
        int64_t pages_per_seq = (live_tokens + group.tokens_per_page - 1) / group.tokens_per_page + 2;
        if (context.max_model_len > 0)
            pages_per_seq = std::min(pages_per_seq, layout.pages_for(0, context.max_model_len + n_heads_ + 1));
        HeadCache hc;
        const int64_t n_pages = pages_per_seq * max_seqs_;
        hc.pool = backend_.alloc(size_t(n_pages * layout.page_bytes));
        char* base = static_cast<char*>(hc.pool.data());
        const int64_t element = int64_t(dtype_size(kv_dtype));
        hc.cache.k = Tensor(base + group.k_offset[0] * element, kv_dtype,
                            {n_pages, group.tokens_per_page, group.n_kv_heads, group.head_dim_k});
        hc.cache.v = Tensor(base + group.v_offset[0] * element, kv_dtype,
                            {n_pages, group.tokens_per_page, group.n_kv_heads, group.head_dim_v});
        hc.kv = std::make_unique<KvCacheManager>(std::move(layout), n_pages, false);
        caches_.push_back(std::move(hc));
        last_hidden_.push_back(allocate(act_, {int64_t(max_seqs_), H}));
    }
    for (int s = max_seqs_ - 1; s >= 0; --s) free_slots_.push_back(s);
}

MtpDrafter::~MtpDrafter() = default;

int64_t MtpDrafter::context_window() const { return attn_.window > 0 ? int64_t(n_heads_) * attn_.window : -1; }

Tensor MtpDrafter::allocate(DType dtype, std::initializer_list<int64_t> shape) {
    Tensor t(nullptr, dtype, shape);
    weight_buffers_.push_back(backend_.alloc(t.nbytes()));
    t.data = weight_buffers_.back().data();
    return t;
}

Tensor MtpDrafter::upload_i32(std::vector<int32_t> host, std::initializer_list<int64_t> dims) {
    Tensor t = workspace_.make(DType::i32, dims);
    host_metadata_.push_back(std::move(host));
    if (t.numel() > 0) backend_.upload(t, host_metadata_.back().data());
    return t;
}

void MtpDrafter::reset_workspace() {
    backend_.synchronize();  // uploads of the previous pass may still read host_metadata_
    workspace_.reset();
    host_metadata_.clear();
}

int MtpDrafter::take_slot(int seq) {
    if (free_slots_.empty())
        fail("MTP drafter: sequence {} needs a slot but all {} (max_num_seqs) are in use", seq, max_seqs_);
    const int slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
}

void MtpDrafter::release(int seq) {
    auto it = states_.find(seq);
    if (it == states_.end()) return;
    for (HeadCache& hc : caches_)
        if (hc.kv->has_sequence(seq)) hc.kv->free_sequence(seq);
    free_slots_.push_back(it->second.slot);
    states_.erase(it);
}

std::vector<int32_t> MtpDrafter::run_head(int head, const HeadBatch& batch, const Tensor& source, const Tensor& out,
                                        const char* tap_name) {
    const MtpHeadWeights& w = heads_[size_t(head)];
    HeadCache& hc = caches_[size_t(head)];
    const int64_t n = int64_t(batch.tokens.size()), H = hidden_;
    const int64_t n_q = attn_.n_q_heads, n_kv = attn_.n_kv_heads, dk = attn_.head_dim_k, dv = attn_.head_dim_v;
    const int n_seqs = int(batch.seqs.size());
    XINFER_CHECK(out.dim(0) == n && out.cols() == H, "MTP head {}: output {} for {} rows", head, out.shape_string(), n);

    // Metadata: cache slots (the attention's positions), RoPE positions (absolute), page tables.
    const KvGroupLayout& group = hc.kv->layout().groups[0];
    const int64_t per_page = group.tokens_per_page;
    std::vector<int32_t> slots_pos, rope_pos, cu{0}, kv_lens, slot_mapping, logit_rows;
    size_t max_pages = 1;
    for (int s = 0; s < n_seqs; ++s) max_pages = std::max(max_pages, hc.kv->page_table(batch.seqs[size_t(s)], 0).size());
    std::vector<int32_t> table(size_t(n_seqs) * max_pages, -1);
    for (int s = 0; s < n_seqs; ++s) {
        const std::vector<int32_t>& pages = hc.kv->page_table(batch.seqs[size_t(s)], 0);
        std::copy(pages.begin(), pages.end(), table.begin() + long(size_t(s) * max_pages));
        for (int64_t i = 0; i < batch.n_rows[size_t(s)]; ++i) {
            const int64_t slot = batch.first_slot[size_t(s)] + i;
            slots_pos.push_back(int32_t(slot));
            rope_pos.push_back(int32_t(batch.first_position[size_t(s)] + i));
            const int32_t page = pages[size_t(slot / per_page)];
            XINFER_CHECK(page >= 0, "MTP head {} sequence {}: slot {} lies on a released page", head,
                         batch.seqs[size_t(s)], slot);
            slot_mapping.push_back(int32_t(page * per_page + slot % per_page));
            if (batch.all_logits || i + 1 == batch.n_rows[size_t(s)]) logit_rows.push_back(int32_t(slots_pos.size() - 1));
        }
        cu.push_back(int32_t(slots_pos.size()));
        kv_lens.push_back(int32_t(batch.first_slot[size_t(s)] + batch.n_rows[size_t(s)]));
    }
    const int64_t n_out = int64_t(logit_rows.size());
    check_tokens_are_newest_keys(cu, kv_lens, slots_pos);
    AttentionBatch ab;
    ab.n_seqs = n_seqs;
    ab.max_pages_per_seq = int(max_pages);
    ab.cu_q_lens = upload_i32(cu, {n_seqs + 1});
    ab.kv_lens = upload_i32(kv_lens, {n_seqs});
    ab.positions = upload_i32(slots_pos, {n});
    ab.page_table = upload_i32(table, {n_seqs, int64_t(max_pages)});
    ab.slot_mapping = upload_i32(slot_mapping, {n});
    ab.page_stride = hc.kv->layout().page_elements();
    const Tensor rope_positions = upload_i32(rope_pos, {n});
    const Tensor token_ids = upload_i32(batch.tokens, {n});
    const Tensor source_rows = upload_i32(batch.source_rows, {n});
    const Tensor out_rows = upload_i32(logit_rows, {n_out});

    Workspace& ws = workspace_;
    backend_.set_layer(-1);
    // z = eh_proj([enorm(embed(t)), hnorm(h)]) as two half-width matmuls.
    Tensor h_in = ws.make(act_, {n, H});      // [n, H] input hiddens
    Tensor embedded = ws.make(act_, {n, H});  // [n, H]
    Tensor normed = ws.make(act_, {n, H});    // [n, H]
    Tensor partial = ws.make(act_, {n, H});   // [n, H]
    backend_.embedding(source, source_rows, h_in);  // row gather
    backend_.embedding(target_.token_embedding(), token_ids, embedded);
    backend_.rmsnorm(embedded, w.enorm, eps_, normed);
    backend_.matmul(normed, w.eh_proj_embed, out);  // out doubles as the residual stream
    backend_.rmsnorm(h_in, w.hnorm, eps_, normed);
    backend_.matmul(normed, w.eh_proj_hidden, partial);
    backend_.add(out, partial);

    // Sliding-window attention with sinks, the target's SWA geometry.
    backend_.rmsnorm(out, w.input_norm, eps_, normed);
    Tensor q = ws.make(act_, {n, n_q, dk});
    Tensor k = ws.make(act_, {n, n_kv, dk});
    Tensor v = ws.make(act_, {n, n_kv, dv});
    backend_.matmul(normed, w.q_proj, q.reshape({n, n_q * dk}));
    backend_.matmul(normed, w.k_proj, k.reshape({n, n_kv * dk}));
    backend_.matmul(normed, w.v_proj, v.reshape({n, n_kv * dv}));
    backend_.rope_kv_store(q, k, v, rope_positions, {attn_.rotary_dim, attn_.rope_theta}, value_scale_, hc.cache.k,
                           hc.cache.v, ab);
    AttentionParams params;
    params.n_q_heads = int(n_q);
    params.n_kv_heads = int(n_kv);
    params.head_dim_k = int(dk);
    params.head_dim_v = int(dv);
    params.softmax_scale = float(1.0 / std::sqrt(double(dk)));
    params.window = attn_.window;
    params.causal = true;
    params.page_size = int(per_page);
    Tensor attn = ws.make(act_, {n, n_q, dv});
    backend_.attention(q, hc.cache.k, hc.cache.v, w.sinks, ab, params, attn);
    backend_.matmul(attn.reshape({n, n_q * dv}), w.o_proj, partial);

    // Dense SwiGLU.
    backend_.add_rmsnorm(out, partial, w.pre_mlp_norm, eps_, normed);
    Tensor gate_up = ws.make(act_, {n, 2 * intermediate_});
    Tensor activated = ws.make(act_, {n, intermediate_});
    backend_.matmul(normed, w.gate_up, gate_up);
    backend_.swiglu(gate_up, activated);
    backend_.matmul(activated, w.down, partial);

    // out = the head's output hidden (chained on), normed = final_layernorm(out) → lm_head.
    backend_.add_rmsnorm(out, partial, w.final_norm, eps_, normed);
    std::vector<int32_t> ids(static_cast<size_t>(n_out));
    if (n_out > 0) {
        Tensor selected = ws.make(act_, {n_out, H});
        Tensor logits = ws.make(DType::f32, {n_out, vocab_});
        backend_.embedding(normed, out_rows, selected);
        backend_.matmul(selected, target_.lm_head(), logits);
        if (tap_) tap_(tap_name, head, logits);
        // Greedy proposals on the device: only the ids cross to the host.
        Tensor device_ids = ws.make(DType::i32, {n_out});
        backend_.argmax(logits, device_ids);
        backend_.download(device_ids, ids.data());
    }
    return ids;
}

void MtpDrafter::observe(const TargetHidden& hidden) {
    // Sequences to advance: known ones continuing where they stopped, new ones from position 0.
    std::vector<size_t> entries;
    for (size_t e = 0; e < hidden.sequences.size(); ++e) {
        const TargetHidden::Sequence& s = hidden.sequences[e];
        // A position is observable once the token after it is known; a sequence that finished in
        // this step may commit its last token without one (it is released right after).
        if (std::min(s.n_committed, int64_t(s.tokens.size()) - 1 - s.start_position) <= 0) continue;
        auto it = states_.find(s.seq);
        if (it != states_.end() && it->second.observed != s.start_position) {
            // Restarted (preempted and resumed without release) or a gap we cannot fill: the
            // heads' caches no longer match; drop the state and start over if we can.
            release(s.seq);
            it = states_.end();
        }
        if (it == states_.end()) {
            // A mid-context start (prefix-cache hit) is observed from there on (see mtp.h).
            if (s.start_position != 0 && context_window() < 0) continue;
            SequenceState state;
            state.base = state.observed = s.start_position;
            state.slot = take_slot(s.seq);
            states_.emplace(s.seq, state);
            for (HeadCache& hc : caches_) hc.kv->add_sequence(s.seq, {});
        }
        entries.push_back(e);
    }
    if (entries.empty()) return;
    XINFER_CHECK(hidden.features.cols() == hidden_, "MTP observe: features {} are not [rows, {}] (final-norm hidden)",
                 hidden.features.shape_string(), hidden_);
    // Passes of at most kMaxRowsPerPass positions per sequence, so a long prefill chunk needs
    // no more KV than window + one pass.
    while (true) {
        std::vector<size_t> active;
        std::vector<int64_t> ends;  // last position (inclusive) of this pass, per active entry
        for (size_t e : entries) {
            const TargetHidden::Sequence& s = hidden.sequences[e];
            const int64_t done = states_.at(s.seq).observed;
            const int64_t last = std::min(s.start_position + s.n_committed, int64_t(s.tokens.size()) - 1) - 1;
            if (done > last) continue;
            active.push_back(e);
            ends.push_back(std::min(last, done + kMaxRowsPerPass - 1));
        }
        if (active.empty()) break;
        observe_pass(hidden, active, ends);
    }
}

void MtpDrafter::observe_pass(const TargetHidden& hidden, const std::vector<size_t>& entries,
                              const std::vector<int64_t>& ends) {
    reset_workspace();
    const int64_t H = hidden_;
    const size_t n_entries = entries.size();
    // Output rows of the previous head this pass, per entry: first position and first row.
    std::vector<int64_t> prev_first_pos(n_entries, 0), prev_first_row(n_entries, 0);
    Tensor prev_out;  // [rows of the previous head, H]
    // last_hidden_[k] ← head k's last row per sequence, applied only after head k+1 has copied
    // the old rows (position observed−1) into its source table.
    struct PendingRow {
        int head, slot;
        Tensor row;  // [1, H] in the workspace
    };
    std::vector<PendingRow> pending;
    auto apply_pending = [&] {
        for (const PendingRow& p : pending) backend_.copy(last_hidden_[size_t(p.head)].slice(p.slot, 1), p.row);
        pending.clear();
    };

    for (int k = 0; k < n_heads_; ++k) {
        HeadCache& hc = caches_[size_t(k)];
        HeadBatch batch;
        batch.all_logits = bool(tap_);
        std::vector<size_t> members;  // entry indices in this head's batch
        std::vector<int64_t> first_pos_of(n_entries, -1), first_row_of(n_entries, 0);
        std::vector<int32_t> src_rows;
        // Source table for the input hiddens: head 0 reads the target's features; head k reads
        // [previous head's rows this pass; last_hidden_[k-1] (one row per slot)].
        const int64_t prev_rows = k == 0 ? 0 : prev_out.dim(0);
        for (size_t i = 0; i < n_entries; ++i) {
            const TargetHidden::Sequence& s = hidden.sequences[entries[i]];
            const SequenceState& state = states_.at(s.seq);
            const int64_t first = std::max<int64_t>(state.observed, state.base + k), last = ends[i];
            if (first > last) continue;
            members.push_back(i);
            first_pos_of[i] = first;
            first_row_of[i] = int64_t(batch.tokens.size());
            batch.seqs.push_back(s.seq);
            batch.first_slot.push_back(first - k - state.base);
            batch.first_position.push_back(first);
            batch.n_rows.push_back(last - first + 1);
            for (int64_t q = first; q <= last; ++q) {
                batch.tokens.push_back(s.tokens[size_t(q + 1)]);
                if (k == 0) {
                    batch.source_rows.push_back(int32_t(s.first_row + (q - s.start_position)));
                } else if (q - 1 >= prev_first_pos[i] && prev_first_pos[i] >= 0) {
                    batch.source_rows.push_back(int32_t(prev_first_row[i] + (q - 1 - prev_first_pos[i])));
                } else {
                    XINFER_CHECK(q - 1 == state.observed - 1, "MTP head {} sequence {}: input position {} is neither "
                                 "stored ({}) nor computed this pass", k, s.seq, q - 1, state.observed - 1);
                    batch.source_rows.push_back(int32_t(prev_rows + state.slot));
                }
            }
            const int64_t slots = last - k - state.base + 1;
            if (!hc.kv->allocate(s.seq, slots))
                fail("MTP head {}: KV pool full: sequence {} needs {} pages for {} slots; {} of {} pages free", k, s.seq,
                     hc.kv->pages_needed(s.seq, slots), slots, hc.kv->free_pages(), hc.kv->n_pages());
        }
        if (members.empty()) break;  // later heads start at later positions: nothing for them either

        Tensor source;
        if (k == 0) {
            source = hidden.features;
        } else {
            // [prev_rows + max_seqs, H]: this pass's rows of head k-1, then its stored last rows.
            source = workspace_.make(act_, {prev_rows + max_seqs_, H});
            if (prev_rows > 0) backend_.copy(source.slice(0, prev_rows), prev_out);
            backend_.copy(source.slice(prev_rows, max_seqs_), last_hidden_[size_t(k - 1)]);
        }
        apply_pending();
        const int64_t n_rows = int64_t(batch.tokens.size());
        Tensor out = workspace_.make(act_, {n_rows, H});
        const std::vector<int32_t> argmax_ids = run_head(k, batch, source, out, "mtp_logits");

        // Bookkeeping: commit the slots, remember each sequence's last output, head 0's draft.
        int64_t out_row = 0;
        for (size_t m = 0; m < members.size(); ++m) {
            const size_t i = members[m];
            const TargetHidden::Sequence& s = hidden.sequences[entries[i]];
            SequenceState& state = states_.at(s.seq);
            const int64_t last_row = first_row_of[i] + batch.n_rows[m] - 1;
            hc.kv->commit(s.seq, s.tokens, ends[i] - k - state.base + 1);
            pending.push_back({k, state.slot, out.slice(last_row, 1)});
            if (k == 0) {
                const int64_t logit_row = batch.all_logits ? last_row : int64_t(m);
                state.next_draft = argmax_ids[size_t(logit_row)];
            }
            out_row += batch.n_rows[m];
        }
        XINFER_CHECK(out_row == n_rows, "MTP head {}: {} rows accounted for, {} computed", k, out_row, n_rows);
        // Head k+1 reads these rows (positions first_pos_of[i]..ends[i] of entry i).
        for (size_t i = 0; i < n_entries; ++i) {
            prev_first_pos[i] = first_pos_of[i];
            prev_first_row[i] = first_row_of[i];
        }
        prev_out = out;
    }
    apply_pending();
    for (size_t i = 0; i < n_entries; ++i) states_.at(hidden.sequences[entries[i]].seq).observed = ends[i] + 1;
    backend_.synchronize();
}

std::vector<std::vector<int32_t>> MtpDrafter::propose(std::span<const DraftRequest> requests) {
    std::vector<std::vector<int32_t>> drafts(requests.size());
    // Which requests can draft, and how many tokens each.
    std::vector<int64_t> n_drafts(requests.size(), 0);
    for (size_t r = 0; r < requests.size(); ++r) {
        auto it = states_.find(requests[r].seq);
        if (it == states_.end() || it->second.observed == it->second.base) continue;
        // The anchor (tokens.back()) must be the token after the last observed position.
        if (int64_t(requests[r].tokens.size()) != it->second.observed + 1) continue;
        n_drafts[r] = std::min<int64_t>(requests[r].max_drafts, n_heads_);
        if (n_drafts[r] <= 0) continue;
        drafts[r].push_back(it->second.next_draft);
    }

    reset_workspace();
    const int64_t H = hidden_;
    Tensor prev_out;                                         // head k-1's propose rows
    std::vector<int64_t> prev_first_row(requests.size(), -1);  // first row of request r in prev_out
    std::vector<int64_t> prev_first_pos(requests.size(), -1);  // its position
    for (int k = 1; k < n_heads_; ++k) {
        HeadCache& hc = caches_[size_t(k)];
        HeadBatch batch;
        batch.all_logits = bool(tap_);
        std::vector<size_t> members;
        std::vector<int64_t> first_row_of(requests.size(), -1), first_pos_of(requests.size(), -1);
        const int64_t prev_rows = k == 1 ? 0 : prev_out.dim(0);
        for (size_t r = 0; r < requests.size(); ++r) {
            if (n_drafts[r] <= k) continue;
            const SequenceState& state = states_.at(requests[r].seq);
            const int64_t P = state.observed - 1;  // last committed position
            // Positions P+1..P+k in slots P+1-k-base..P-base; positions below base + k do not exist
            // for head k (short prompts), its chain then starts at position base + k, slot 0.
            const int64_t first = std::max<int64_t>(P + 1, state.base + k);
            members.push_back(r);
            first_row_of[r] = int64_t(batch.tokens.size());
            first_pos_of[r] = first;
            batch.seqs.push_back(requests[r].seq);
            batch.first_slot.push_back(first - k - state.base);
            batch.first_position.push_back(first);
            batch.n_rows.push_back(P + k - first + 1);
            for (int64_t q = first; q <= P + k; ++q) {
                batch.tokens.push_back(drafts[r][size_t(q - P - 1)]);  // t_{q+1} = d_{q-P-1}
                // out^{k-1}_{q-1}: position P from observe, later ones from head k-1's propose rows.
                if (q - 1 == P) {
                    batch.source_rows.push_back(int32_t(prev_rows + state.slot));
                } else {
                    XINFER_CHECK(prev_first_pos[r] >= 0 && q - 1 >= prev_first_pos[r],
                                 "MTP head {} sequence {}: input position {} was not drafted by head {}", k,
                                 requests[r].seq, q - 1, k - 1);
                    batch.source_rows.push_back(int32_t(prev_first_row[r] + (q - 1 - prev_first_pos[r])));
                }
            }
            if (!hc.kv->allocate(requests[r].seq, P + 1 - state.base))
                fail("MTP head {}: KV pool full drafting for sequence {} ({} slots; {} of {} pages free)", k,
                     requests[r].seq, P + 1 - state.base, hc.kv->free_pages(), hc.kv->n_pages());
        }
        if (members.empty()) break;
        Tensor source = workspace_.make(act_, {prev_rows + max_seqs_, H});
        if (prev_rows > 0) backend_.copy(source.slice(0, prev_rows), prev_out);
        backend_.copy(source.slice(prev_rows, max_seqs_), last_hidden_[size_t(k - 1)]);
        Tensor out = workspace_.make(act_, {int64_t(batch.tokens.size()), H});
        const std::vector<int32_t> argmax_ids = run_head(k, batch, source, out, "mtp_draft_logits");
        for (size_t m = 0; m < members.size(); ++m) {
            const size_t r = members[m];
            const int64_t logit_row = batch.all_logits ? first_row_of[r] + batch.n_rows[m] - 1 : int64_t(m);
            drafts[r].push_back(argmax_ids[size_t(logit_row)]);
            // Roll the draft rows back: only committed positions stay in the cache.
            hc.kv->truncate(requests[r].seq, hc.kv->committed_tokens(requests[r].seq));
        }
        prev_first_row = first_row_of;
        prev_first_pos = first_pos_of;
        prev_out = out;
    }
    backend_.synchronize();
    return drafts;
}

std::unique_ptr<Drafter> make_mtp_drafter(const SpeculativeConfig& config, const DrafterContext& context) {
    return std::make_unique<MtpDrafter>(config, context);
}

}  // namespace xinfer
