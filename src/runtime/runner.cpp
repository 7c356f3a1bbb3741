#include "runtime/runner.h"

#include "core/status.h"
#include "runtime/memory_plan.h"

#include <algorithm>
#include <bit>

namespace xinfer {
namespace {

KvCacheManager make_manager(const Model& model, const RunnerOptions& options) {
    const ModelConfig& config = model.config();
    const DType dtype = resolve_kv_cache_dtype(options.kv_cache_dtype, model.activation_dtype());
    KvLayout layout = make_kv_layout(kv_group_shapes(config), dtype, options.page_size);
    int64_t n_pages = options.n_pages;
    if (n_pages <= 0) {
        XINFER_CHECK(options.max_cached_tokens > 0, "RunnerOptions: max_cached_tokens {} or n_pages {} must be positive",
                     options.max_cached_tokens, options.n_pages);
        for (size_t g = 0; g < layout.groups.size(); ++g) n_pages += layout.pages_for(int(g), options.max_cached_tokens);
    }
    return KvCacheManager(std::move(layout), n_pages, options.enable_prefix_caching);
}

}  // namespace

std::vector<KvGroupShape> kv_group_shapes(const ModelConfig& config) {
    std::vector<KvGroupShape> shapes;
    for (const KvGroupSpec& spec : kv_groups_for(config))
        shapes.push_back({spec.kind == AttentionKind::sliding, spec.window, spec.n_kv_heads, spec.head_dim_k,
                          spec.head_dim_v, spec.layers});
    return shapes;
}

DType resolve_kv_cache_dtype(const std::string& name, DType activation) {
    if (name == "auto" || name.empty()) return activation;
    if (name == "float32" || name == "f32") return DType::f32;
    if (name == "bfloat16" || name == "bf16") return DType::bf16;
    // e4m3 values with one f32 scale per (token, kv head) row, inside the pages (src/kv/kv_layout.h).
    if (name == "fp8" || name == "fp8_e4m3" || name == "f8_e4m3") return DType::f8_e4m3;
    fail("--kv-cache-dtype {}: unknown (expected auto, float32, bfloat16, fp8 or fp8_e4m3)", name);
}

Runner::Runner(Model& model, Backend& backend, RunnerOptions options)
    : model_(model),
      backend_(backend),
      workspace_(backend),
      kv_(make_manager(model, options)),
      feature_layers_(options.feature_layers),
      options_(options),
      graphs_enabled_(!options.enforce_eager && backend.has_graphs() && !graphs_disabled_by_env()) {
    for (int layer : feature_layers_)
        XINFER_CHECK(layer == kFinalNormFeature || (layer >= 0 && layer < int(model.config().layers.size())),
                     "feature layer {} outside the target's {} layers", layer, model.config().layers.size());
    const KvLayout& layout = kv_.layout();
    pool_ = backend.alloc(size_t(kv_.n_pages() * layout.page_bytes));
    const size_t n_layers = model.config().layers.size();
    caches_.resize(n_layers);
    layer_group_.assign(n_layers, -1);
    for (size_t g = 0; g < layout.groups.size(); ++g) {
        const KvGroupLayout& group = layout.groups[g];
        for (size_t i = 0; i < group.layers.size(); ++i) {
            const size_t layer = size_t(group.layers[i]);
            layer_group_[layer] = int(g);
            // Layer i's K of page p starts at pool + p·page_elements + k_offset[i] (elements):
            // the view points at page 0 and AttentionBatch::page_stride steps between pages. An
            // fp8 view's shape covers its e4m3 values; their scales follow them in each page.
            char* base = static_cast<char*>(pool_.data());
            const int64_t element = int64_t(dtype_size(layout.dtype));
            caches_[layer].k = Tensor(base + group.k_offset[i] * element, layout.dtype,
                                      {kv_.n_pages(), group.tokens_per_page, group.n_kv_heads, group.head_dim_k});
            caches_[layer].v = Tensor(base + group.v_offset[i] * element, layout.dtype,
                                      {kv_.n_pages(), group.tokens_per_page, group.n_kv_heads, group.head_dim_v});
        }
    }
    for (size_t layer = 0; layer < n_layers; ++layer)
        XINFER_CHECK(layer_group_[layer] >= 0, "layer {} belongs to no KV group", layer);
}

DecodeGraphs& Runner::decode_graphs() {
    if (!graphs_) {
        int64_t max_seq_len = options_.max_seq_len;
        if (max_seq_len <= 0)
            max_seq_len = options_.n_pages > 0
                              ? std::min<int64_t>(kMaxGraphSeqLen, max_sequence_tokens(kv_.layout(), kv_.n_pages(), 1))
                              : options_.max_cached_tokens;
        graphs_ = std::make_unique<DecodeGraphs>(model_, backend_, kv_, caches_, layer_group_, options_.max_graph_batch,
                                                 std::max<int64_t>(1, max_seq_len));
    }
    return *graphs_;
}

int Runner::capture_graphs() { return graphs_enabled_ ? decode_graphs().capture_all() : 0; }

std::vector<float> Runner::forward(std::span<const SequenceChunk> chunks, const TapFn& tap) {
    return download_logits(forward_on_device(chunks, tap));
}

std::vector<float> Runner::download_logits(const Tensor& logits) { return download_synchronized<float>(logits); }

template <typename T>
std::vector<T> Runner::download_synchronized(const Tensor& t) {
    std::vector<T> host(size_t(t.numel()));
    backend_.download(t, host.data());
    return host;
}

std::vector<int32_t> Runner::argmax_rows(const Tensor& logits) {
    return download_synchronized<int32_t>(argmax_rows_on_device(logits));
}

Tensor Runner::argmax_rows_on_device(const Tensor& logits) {
    if (graphs_)
        if (std::optional<Tensor> ids = graphs_->argmax_of(logits)) return *ids;  // computed inside the step's graph
    const int64_t rows = logits.dim(0);
    if (argmax_ids_.bytes() < size_t(rows) * sizeof(int32_t)) argmax_ids_ = backend_.alloc(size_t(rows) * sizeof(int32_t));
    const Tensor ids(argmax_ids_.data(), DType::i32, {rows});  // [n_out]
    backend_.argmax(logits, ids);
    return ids;
}

std::vector<int32_t> Runner::sample_rows(const Tensor& logits, std::span<const RowSampling> rows) {
    return download_synchronized<int32_t>(sample_rows_on_device(logits, rows));
}

Tensor Runner::sample_rows_on_device(const Tensor& logits, std::span<const RowSampling> rows) {
    const int64_t n = logits.dim(0);
    XINFER_CHECK(int64_t(rows.size()) == n, "sample_rows: {} sampling rows for {} logits rows", rows.size(), n);
    if (std::all_of(rows.begin(), rows.end(), [](const RowSampling& r) { return r.temperature <= 0.f; }))
        return argmax_rows_on_device(logits);
    // The op's four [n] inputs as consecutive columns of 4-byte values (one upload), then the ids.
    std::vector<int32_t> args(size_t(4 * n));
    for (size_t r = 0; r < rows.size(); ++r) {
        args[r] = std::bit_cast<int32_t>(rows[r].temperature);
        args[size_t(n) + r] = std::bit_cast<int32_t>(rows[r].top_p);
        args[size_t(2 * n) + r] = rows[r].top_k;
        args[size_t(3 * n) + r] = std::bit_cast<int32_t>(rows[r].uniform);
    }
    if (sampling_args_.bytes() < size_t(5 * n) * 4) sampling_args_ = backend_.alloc(size_t(5 * n) * 4);
    int32_t* base = static_cast<int32_t*>(sampling_args_.data());
    backend_.upload(Tensor(base, DType::i32, {4 * n}), args.data());
    const auto column = [&](int64_t c, DType dtype) { return Tensor(base + c * n, dtype, {n}); };
    const Tensor ids = column(4, DType::i32);
    backend_.sample(logits, column(0, DType::f32), column(1, DType::f32), column(2, DType::i32), column(3, DType::f32),
                    ids);
    return ids;
}

Tensor Runner::forward_on_device(std::span<const SequenceChunk> chunks, const TapFn& tap, const Tensor& device_tokens) {
    XINFER_CHECK(!chunks.empty(), "empty step");
    // Plain decode steps replay their bucket's graph; a graph would hide taps, the feature
    // copies and per-op observation, so those steps run eagerly.
    if (graphs_enabled_ && !tap && feature_layers_.empty() && !backend_.has_op_observer() && is_plain_decode(chunks))
        if (std::optional<Tensor> logits = decode_graphs().forward(chunks, device_tokens)) return *logits;
    const KvLayout& layout = kv_.layout();
    std::vector<int32_t> token_ids, positions, cu_q_lens{0}, kv_lens, logit_rows;
    for (const SequenceChunk& chunk : chunks) {
        XINFER_CHECK(!chunk.tokens.empty(), "sequence {} has no new tokens", chunk.seq);
        const int64_t kv_len = chunk.start_position + int64_t(chunk.tokens.size());
        XINFER_CHECK(kv_.allocated_tokens(chunk.seq) >= kv_len, "sequence {} has {} tokens allocated, needs {}",
                     chunk.seq, kv_.allocated_tokens(chunk.seq), kv_len);
        const int32_t first_row = int32_t(token_ids.size());
        for (size_t i = 0; i < chunk.tokens.size(); ++i) {
            token_ids.push_back(chunk.tokens[i]);
            positions.push_back(int32_t(chunk.start_position + int64_t(i)));
            if (chunk.all_logits || i + 1 == chunk.tokens.size()) logit_rows.push_back(first_row + int32_t(i));
        }
        cu_q_lens.push_back(int32_t(token_ids.size()));
        kv_lens.push_back(int32_t(kv_len));
    }
    const int n_tokens = int(token_ids.size()), n_seqs = int(chunks.size());
    check_tokens_are_newest_keys(cu_q_lens, kv_lens, positions);

    // Host metadata → backend tensors in the step workspace (an upload has read its source when
    // it returns). The workspace's slots may still be read by the previous step on the device:
    // uploads are stream-ordered, so they land after it.
    workspace_.reset();
    auto upload = [&](const std::vector<int32_t>& host, std::initializer_list<int64_t> dims) {
        Tensor t = workspace_.make(DType::i32, dims);
        backend_.upload(t, host.data());
        return t;
    };

    ForwardBatch batch;
    batch.n_tokens = n_tokens;
    batch.token_ids = upload(token_ids, {n_tokens});
    if (device_tokens.data) backend_.copy(batch.token_ids, device_tokens);
    batch.positions = upload(positions, {n_tokens});
    const int64_t n_out = int64_t(logit_rows.size());
    batch.logit_rows = upload(logit_rows, {n_out});
    Tensor cu = upload(cu_q_lens, {n_seqs + 1});
    Tensor lens = upload(kv_lens, {n_seqs});
    for (size_t g = 0; g < layout.groups.size(); ++g) {
        const int64_t per_page = layout.groups[g].tokens_per_page;
        size_t max_pages = 1;
        for (const SequenceChunk& chunk : chunks) max_pages = std::max(max_pages, kv_.page_table(chunk.seq, int(g)).size());
        std::vector<int32_t> table(size_t(n_seqs) * max_pages, -1), slots;
        slots.reserve(size_t(n_tokens));
        for (size_t s = 0; s < chunks.size(); ++s) {
            const std::vector<int32_t>& pages = kv_.page_table(chunks[s].seq, int(g));
            std::copy(pages.begin(), pages.end(), table.begin() + long(s * max_pages));
            for (size_t i = 0; i < chunks[s].tokens.size(); ++i) {
                const int64_t pos = chunks[s].start_position + int64_t(i);
                const int32_t page = pages[size_t(pos / per_page)];
                XINFER_CHECK(page >= 0, "sequence {} group {}: position {} lies on a released page", chunks[s].seq, g,
                             pos);
                slots.push_back(int32_t(page * per_page + pos % per_page));
            }
        }
        AttentionBatch group;
        group.n_seqs = n_seqs;
        group.max_pages_per_seq = int(max_pages);
        group.cu_q_lens = cu;
        group.kv_lens = lens;
        group.positions = batch.positions;
        group.page_table = upload(table, {n_seqs, int64_t(max_pages)});
        group.slot_mapping = upload(slots, {n_tokens});
        group.page_stride = layout.page_elements();
        batch.groups.push_back(group);
    }
    batch.layer_group = layer_group_;
    batch.caches = caches_;
    batch.tap = feature_layers_.empty() ? tap : exporting_tap(n_tokens, tap);

    const int64_t vocab = model_.config().vocab_size;
    Tensor logits = workspace_.make(DType::f32, {n_out, vocab});
    model_.forward(batch, logits);
    if (!feature_layers_.empty()) gather_features(n_tokens);
    return logits;
}

// Each exported layer's output is copied, as the forward reaches it, into a layer-major staging
// tensor [n_features, n_tokens, hidden]; gather_features() then interleaves it into the
// token-major [n_tokens, n_features * hidden] with one row gather (the embedding op).
TapFn Runner::exporting_tap(int64_t n_tokens, const TapFn& user_tap) {
    const int64_t hidden = model_.config().hidden_size, n_features = int64_t(feature_layers_.size());
    feature_staging_ = workspace_.make(model_.activation_dtype(), {n_features * n_tokens, hidden});
    return [this, n_tokens, hidden, user_tap](std::string_view name, int layer, const Tensor& value) {
        if (user_tap) user_tap(name, layer, value);
        const bool final_norm = name == "final_norm";
        if (!final_norm && name != "residual") return;
        for (size_t i = 0; i < feature_layers_.size(); ++i) {
            if (final_norm ? feature_layers_[i] != kFinalNormFeature : feature_layers_[i] != layer) continue;
            char* base = static_cast<char*>(feature_staging_.data);
            const Tensor slot(base + int64_t(i) * n_tokens * hidden * int64_t(dtype_size(value.dtype)), value.dtype,
                              {n_tokens, hidden});
            backend_.copy(slot, value);
        }
    };
}

void Runner::gather_features(int64_t n_tokens) {
    const int64_t hidden = model_.config().hidden_size, n_features = int64_t(feature_layers_.size());
    if (n_features == 1) {
        features_ = feature_staging_;
        return;
    }
    // Token t's feature i is staging row i·n_tokens + t; it goes to output row t·n_features + i.
    std::vector<int32_t> rows(size_t(n_tokens * n_features));
    for (int64_t t = 0; t < n_tokens; ++t)
        for (int64_t i = 0; i < n_features; ++i) rows[size_t(t * n_features + i)] = int32_t(i * n_tokens + t);
    Tensor ids = workspace_.make(DType::i32, {n_tokens * n_features});
    backend_.upload(ids, rows.data());
    Tensor gathered = workspace_.make(feature_staging_.dtype, {n_tokens * n_features, hidden});
    backend_.embedding(feature_staging_, ids, gathered);
    features_ = gathered.reshape({n_tokens, n_features * hidden});
}

std::vector<float> Runner::step(std::span<const SequenceChunk> chunks, const TapFn& tap) {
    return download_logits(step_on_device(chunks, tap));
}

Tensor Runner::step_on_device(std::span<const SequenceChunk> chunks, const TapFn& tap, const Tensor& device_tokens) {
    // A token's value enters the prefix cache's page hashes at commit: unknown here.
    XINFER_CHECK(!device_tokens.data || !options_.enable_prefix_caching,
                 "step_on_device: tokens read on the device need prefix caching off");
    for (const SequenceChunk& chunk : chunks) {
        std::vector<int32_t>& tokens = step_tokens_[chunk.seq];
        if (!kv_.has_sequence(chunk.seq)) kv_.add_sequence(chunk.seq, {});
        XINFER_CHECK(chunk.start_position == int64_t(tokens.size()),
                     "sequence {}: chunk starts at {} but {} tokens are cached", chunk.seq, chunk.start_position,
                     tokens.size());
        tokens.insert(tokens.end(), chunk.tokens.begin(), chunk.tokens.end());
        if (!kv_.allocate(chunk.seq, int64_t(tokens.size())))
            fail("KV cache full: sequence {} needs {} pages for {} tokens; {} of {} pages free", chunk.seq,
                 kv_.pages_needed(chunk.seq, int64_t(tokens.size())), tokens.size(), kv_.free_pages(), kv_.n_pages());
    }
    const Tensor logits = forward_on_device(chunks, tap, device_tokens);
    for (const SequenceChunk& chunk : chunks) {
        const std::vector<int32_t>& tokens = step_tokens_[chunk.seq];
        kv_.commit(chunk.seq, tokens, int64_t(tokens.size()));
    }
    return logits;
}

void Runner::set_token(int seq, int64_t position, int32_t token) {
    std::vector<int32_t>& tokens = step_tokens_[seq];
    XINFER_CHECK(position >= 0 && position < int64_t(tokens.size()), "set_token: sequence {} has no position {}", seq,
                 position);
    tokens[size_t(position)] = token;
}

void Runner::release(int seq) {
    if (kv_.has_sequence(seq)) kv_.free_sequence(seq);
    step_tokens_.erase(seq);
}

}  // namespace xinfer
