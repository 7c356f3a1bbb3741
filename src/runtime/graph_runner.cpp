#include "runtime/graph_runner.h"

#include "core/status.h"
#include "runtime/runner.h"

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace xinfer {

std::vector<int> decode_graph_batch_sizes(int max_batch) {
    std::vector<int> sizes;
    for (int size = 1; size <= kMaxGraphBatch && max_batch > 0; size *= 2) {
        sizes.push_back(size);
        if (size >= max_batch) break;
    }
    return sizes;
}

int pick_graph_batch(std::span<const int> sizes, int n) {
    if (n <= 0) return 0;
    for (int size : sizes)
        if (size >= n) return size;
    return 0;
}

bool is_plain_decode(std::span<const SequenceChunk> chunks) {
    if (chunks.empty()) return false;
    return std::all_of(chunks.begin(), chunks.end(), [](const SequenceChunk& c) { return c.tokens.size() == 1; });
}

bool graphs_disabled_by_env() {
    const char* value = std::getenv("XINFER_CUDA_GRAPHS");
    if (!value) return false;
    const std::string_view v(value);
    return v == "0" || v == "false" || v == "off" || v == "no";
}

DecodeMetadataLayout decode_metadata_layout(int batch, std::span<const int64_t> widths) {
    XINFER_CHECK(batch > 0, "decode graph batch {} must be positive", batch);
    DecodeMetadataLayout layout;
    layout.batch = batch;
    layout.widths.assign(widths.begin(), widths.end());
    int64_t at = 0;
    auto take = [&](int64_t n) {
        const int64_t offset = at;
        at += (n + 3) / 4 * 4;  // 16-byte aligned fields
        return offset;
    };
    layout.token_ids = take(batch);
    layout.positions = take(batch);
    layout.cu_q_lens = take(batch + 1);
    layout.kv_lens = take(batch);
    layout.logit_rows = take(batch);
    for (int64_t width : widths) {
        XINFER_CHECK(width > 0, "page-table width {} must be positive", width);
        layout.page_tables.push_back(take(batch * width));
        layout.slot_mappings.push_back(take(batch));
    }
    layout.size = at;
    return layout;
}

bool fill_decode_metadata(const DecodeMetadataLayout& layout, std::span<const DecodeRow> rows,
                          std::span<const int64_t> tokens_per_page, std::vector<int32_t>& out) {
    const size_t n_groups = layout.widths.size();
    XINFER_CHECK(tokens_per_page.size() == n_groups, "{} groups' tokens_per_page for {} page tables",
                 tokens_per_page.size(), n_groups);
    if (rows.size() > size_t(layout.batch)) return false;
    for (const DecodeRow& row : rows) {
        XINFER_CHECK(row.tables.size() == n_groups, "decode row has {} page tables for {} groups", row.tables.size(),
                     n_groups);
        for (size_t g = 0; g < n_groups; ++g)
            if (row.position / tokens_per_page[g] >= layout.widths[g]) return false;
    }
    // Inert rows: token 0 at position 0 with no keys (kv_len 0) and no slot (-1): they write no
    // K/V and attend to nothing; their outputs are computed and ignored.
    out.assign(size_t(layout.size), 0);
    for (size_t g = 0; g < n_groups; ++g) {
        std::fill_n(out.begin() + layout.page_tables[g], layout.batch * layout.widths[g], -1);
        std::fill_n(out.begin() + layout.slot_mappings[g], layout.batch, -1);
    }
    for (int s = 0; s < layout.batch; ++s) {
        out[size_t(layout.cu_q_lens + s + 1)] = s + 1;  // one query row per sequence, padded ones too
        out[size_t(layout.logit_rows + s)] = s;
    }
    for (size_t s = 0; s < rows.size(); ++s) {
        const DecodeRow& row = rows[s];
        out[size_t(layout.token_ids) + s] = row.token;
        out[size_t(layout.positions) + s] = int32_t(row.position);
        out[size_t(layout.kv_lens) + s] = int32_t(row.position + 1);
        for (size_t g = 0; g < n_groups; ++g) {
            const std::vector<int32_t>& pages = *row.tables[g];
            const int64_t per_page = tokens_per_page[g], logical = row.position / per_page;
            XINFER_CHECK(logical < int64_t(pages.size()) && pages[size_t(logical)] >= 0,
                         "decode row {} group {}: position {} lies on a page that is not resident ({} pages)", s, g,
                         row.position, pages.size());
            const size_t n = std::min(pages.size(), size_t(layout.widths[g]));
            std::copy_n(pages.begin(), n, out.begin() + layout.page_tables[g] + int64_t(s) * layout.widths[g]);
            out[size_t(layout.slot_mappings[g]) + s] = int32_t(pages[size_t(logical)] * per_page + row.position % per_page);
        }
    }
    return true;
}

DecodeGraphs::DecodeGraphs(Model& model, Backend& backend, const KvCacheManager& kv,
                           const std::vector<LayerCache>& caches, const std::vector<int>& layer_group, int max_batch,
                           int64_t max_seq_len)
    : model_(model),
      backend_(backend),
      kv_(kv),
      caches_(caches),
      layer_group_(layer_group),
      sizes_(decode_graph_batch_sizes(max_batch)) {
    XINFER_CHECK(max_seq_len > 0, "decode graphs need a positive max_seq_len, got {}", max_seq_len);
    const KvLayout& layout = kv_.layout();
    for (size_t g = 0; g < layout.groups.size(); ++g) {
        tokens_per_page_.push_back(layout.groups[g].tokens_per_page);
        widths_.push_back(std::max<int64_t>(1, layout.pages_for(int(g), max_seq_len)));
    }
    int64_t metadata_elements = 0;
    for (int size : sizes_) {
        buckets_.push_back({decode_metadata_layout(size, widths_)});
        XINFER_CHECK(buckets_.back().layout.token_ids == 0, "the token slots must open every bucket's inputs");
        metadata_elements = std::max(metadata_elements, buckets_.back().layout.size);
    }
    if (sizes_.empty()) return;
    const size_t metadata_bytes = size_t(metadata_elements) * sizeof(int32_t);
    metadata_ = backend_.alloc(metadata_bytes);
    for (Backend::MappedBuffer& inputs : inputs_) inputs = backend_.alloc_mapped(metadata_bytes);
    if (!inputs_[0].host || !inputs_[1].host)
        for (Backend::MappedBuffer& inputs : inputs_) inputs = {backend_.alloc(metadata_bytes), nullptr};
    logits_ = backend_.alloc(size_t(sizes_.back()) * size_t(model_.config().vocab_size) * sizeof(float));
}

DecodeGraphs::~DecodeGraphs() {
    for (Bucket& bucket : buckets_)
        for (void* graph : bucket.graphs)
            if (graph) backend_.graph_destroy(graph);
}

ForwardBatch DecodeGraphs::batch_for(const Bucket& bucket) const {
    const DecodeMetadataLayout& L = bucket.layout;
    int32_t* base = static_cast<int32_t*>(metadata_.data());
    auto view = [&](int64_t offset, std::initializer_list<int64_t> dims) { return Tensor(base + offset, DType::i32, dims); };
    const int64_t n = L.batch;
    ForwardBatch batch;
    batch.n_tokens = L.batch;
    batch.token_ids = view(L.token_ids, {n});
    batch.positions = view(L.positions, {n});
    batch.logit_rows = view(L.logit_rows, {n});
    for (size_t g = 0; g < L.widths.size(); ++g) {
        AttentionBatch group;
        group.n_seqs = L.batch;
        group.max_pages_per_seq = int(L.widths[g]);
        group.cu_q_lens = view(L.cu_q_lens, {n + 1});
        group.kv_lens = view(L.kv_lens, {n});
        group.positions = batch.positions;
        group.page_table = view(L.page_tables[g], {n, L.widths[g]});
        group.slot_mapping = view(L.slot_mappings[g], {n});
        group.page_stride = kv_.layout().page_elements();
        batch.groups.push_back(group);
    }
    batch.layer_group = layer_group_;
    batch.caches = caches_;
    return batch;
}

Tensor DecodeGraphs::logits_for(int rows) const {
    return Tensor(logits_.data(), DType::f32, {int64_t(rows), model_.config().vocab_size});
}

Tensor DecodeGraphs::tokens_of(int parity, int rows) const {
    return Tensor(inputs_[parity].device.data(), DType::i32, {int64_t(rows)});  // layout.token_ids is 0
}

std::optional<Tensor> DecodeGraphs::argmax_of(const Tensor& logits) const {
    if (logits.data != logits_.data() || logits.dtype != DType::f32 || logits.rank != 2 || logits.dim(0) > ids_rows_)
        return std::nullopt;
    return tokens_of(parity_, int(logits.dim(0)));
}

void DecodeGraphs::write_inputs(const Bucket& bucket, int parity, int64_t first) {
    XINFER_CHECK(int64_t(staging_.size()) == bucket.layout.size, "staged {} input elements for a layout of {}",
                 staging_.size(), bucket.layout.size);
    const int64_t n = bucket.layout.size - first;
    if (void* host = inputs_[parity].host)
        std::memcpy(static_cast<int32_t*>(host) + first, staging_.data() + first, size_t(n) * sizeof(int32_t));
    else
        backend_.upload(Tensor(static_cast<int32_t*>(inputs_[parity].device.data()) + first, DType::i32, {n}),
                        staging_.data() + first);
}

void DecodeGraphs::run_step(const Bucket& bucket, int parity) {
    const int64_t size = bucket.layout.size, rows = bucket.layout.batch;
    backend_.copy(Tensor(metadata_.data(), DType::i32, {size}), Tensor(inputs_[parity].device.data(), DType::i32, {size}));
    const Tensor logits = logits_for(int(rows));
    model_.forward(batch_for(bucket), logits);
    backend_.argmax(logits, tokens_of(1 - parity, int(rows)));
}

void DecodeGraphs::capture(Bucket& bucket, int parity) {
    // The eager run sizes the plugin's scratch and the model's workspace slots for these shapes
    // (nothing may allocate during capture); its logits and ids are this step's result. The two
    // parities run the same ops on the same shapes.
    run_step(bucket, parity);
    try {
        for (int p : {0, 1}) {
            backend_.graph_begin();
            try {
                run_step(bucket, p);
            } catch (...) {
                // Close the capture so the stream is usable again; the partial graph is discarded.
                void* partial = nullptr;
                try {
                    partial = backend_.graph_end();
                } catch (...) {
                }
                if (partial) backend_.graph_destroy(partial);
                throw;
            }
            bucket.graphs[p] = backend_.graph_end();
        }
        ++stats_.captures;
    } catch (const std::exception& e) {
        for (void*& graph : bucket.graphs) {
            if (graph) backend_.graph_destroy(graph);
            graph = nullptr;
        }
        bucket.failed = true;
        ++stats_.failed_captures;
        fmt::print(stderr, "warning: {}: capturing the decode graph of batch {} failed; that batch runs eagerly: {}\n",
                   backend_.name(), bucket.layout.batch, e.what());
    }
}

std::optional<Tensor> DecodeGraphs::forward(std::span<const SequenceChunk> chunks, const Tensor& device_tokens) {
    ids_rows_ = 0;  // until this step has computed them
    const int n = int(chunks.size());
    const int size = pick_graph_batch(sizes_, n);
    if (size == 0 || !is_plain_decode(chunks)) return std::nullopt;
    Bucket& bucket = buckets_[size_t(std::find(sizes_.begin(), sizes_.end(), size) - sizes_.begin())];
    if (bucket.failed) return std::nullopt;

    std::vector<DecodeRow> rows(chunks.size());
    for (size_t s = 0; s < chunks.size(); ++s) {
        const SequenceChunk& chunk = chunks[s];
        XINFER_CHECK(kv_.allocated_tokens(chunk.seq) >= chunk.start_position + 1,
                     "sequence {} has {} tokens allocated, needs {}", chunk.seq, kv_.allocated_tokens(chunk.seq),
                     chunk.start_position + 1);
        rows[s].token = chunk.tokens[0];
        rows[s].position = chunk.start_position;
        for (size_t g = 0; g < widths_.size(); ++g) rows[s].tables.push_back(&kv_.page_table(chunk.seq, int(g)));
    }
    if (!fill_decode_metadata(bucket.layout, rows, tokens_per_page_, staging_)) return std::nullopt;
    const int p = parity_;
    if (!device_tokens.data) {
        // The last graph may still write its ids into these token slots: wait for it.
        if (inputs_[p].host) backend_.synchronize();
        write_inputs(bucket, p, 0);
    } else {
        // The real rows' token slots come first and are left alone: the last step's ids are in
        // them already, or a copy puts the tokens there in stream order. The padding rows' slots
        // get token 0 here, or keep the last graph's ids for them if it writes after the host:
        // valid tokens either way, which inert rows need and nothing reads.
        write_inputs(bucket, p, n);
        if (device_tokens.data != inputs_[p].device.data()) backend_.copy(tokens_of(p, n), device_tokens);
    }
    if (bucket.graphs[p]) {
        backend_.graph_launch(bucket.graphs[p]);
        ++stats_.replays;
    } else {
        capture(bucket, p);
        ++stats_.capture_steps;
    }
    last_replayed_ = bucket.graphs[p] ? &bucket : nullptr;
    parity_ = 1 - p;  // this step's ids are in the token slots of inputs_[1 - p]
    ids_rows_ = n;
    return logits_for(n);
}

DecodeGraphs::ReplayTimes DecodeGraphs::time_last_replay(int n) {
    ReplayTimes times;
    if (!last_replayed_ || !backend_.has_events() || n <= 0) return times;
    const Bucket& bucket = *last_replayed_;
    const int p = 1 - parity_, rows = bucket.layout.batch;  // only graph steps flip parity_
    const Tensor ids = tokens_of(1 - p, rows);
    std::vector<int32_t> host_ids(size_t(rows) * size_t(n));
    // What an overlapped step queues: without mapped memory the inputs' upload (the same bytes
    // again, past the token slots) before the graph; the ids' download after it.
    const auto measure = [&](bool whole_step) {
        void* start = backend_.event_record();
        for (int i = 0; i < n; ++i) {
            if (whole_step && !inputs_[p].host) write_inputs(bucket, p, int64_t(rows));
            backend_.graph_launch(bucket.graphs[p]);
            if (whole_step) backend_.download_async(ids, host_ids.data() + size_t(i) * size_t(rows));
        }
        void* end = backend_.event_record();
        const double seconds = backend_.event_elapsed_ms(start, end) / 1e3 / n;
        backend_.wait_downloads();
        backend_.event_destroy(start);
        backend_.event_destroy(end);
        return seconds;
    };
    times.graph = measure(false);
    times.step = measure(true);
    return times;
}

int DecodeGraphs::capture_all() {
    int captured = 0;
    for (Bucket& bucket : buckets_) {
        if (bucket.graphs[0] || bucket.failed) continue;
        fill_decode_metadata(bucket.layout, {}, tokens_per_page_, staging_);  // every row inert
        backend_.synchronize();  // the last eager run may still read the inputs
        write_inputs(bucket, parity_, 0);
        capture(bucket, parity_);
        captured += bucket.graphs[0] ? 1 : 0;
    }
    backend_.synchronize();
    return captured;
}

}  // namespace xinfer
