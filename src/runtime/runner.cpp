#include "runtime/runner.h"

#include "core/status.h"

#include <algorithm>

namespace xinfer {

Runner::Runner(Model& model, Backend& backend, RunnerOptions options)
    : model_(model),
      backend_(backend),
      groups_(kv_groups_for(model.config())),
      workspace_(backend),
      kv_(int(groups_.size()), options.page_size,
          (options.max_cached_tokens + options.page_size - 1) / options.page_size) {
    const ModelConfig& config = model.config();
    caches_.resize(config.layers.size());
    layer_group_.resize(config.layers.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
        const KvGroupSpec& spec = groups_[g];
        for (int layer : spec.layers) {
            layer_group_[size_t(layer)] = int(g);
            LayerCache& cache = caches_[size_t(layer)];
            // The cache holds K/V in the activation dtype (f32 on the CPU oracle, bf16 on devices).
            const DType dtype = model.activation_dtype();
            cache.k = Tensor(nullptr, dtype, {kv_.pages_per_group(), options.page_size, spec.n_kv_heads, spec.head_dim_k});
            cache.v = Tensor(nullptr, dtype, {kv_.pages_per_group(), options.page_size, spec.n_kv_heads, spec.head_dim_v});
            for (Tensor* t : {&cache.k, &cache.v}) {
                cache_buffers_.push_back(backend.alloc(t->nbytes()));
                t->data = cache_buffers_.back().data();
            }
        }
    }
}

std::vector<float> Runner::step(std::span<const SequenceChunk> chunks, const TapFn& tap) {
    XINFER_CHECK(!chunks.empty(), "empty step");
    const int page_size = kv_.page_size();
    std::vector<int32_t> token_ids, positions, cu_q_lens{0}, kv_lens, logit_rows;
    for (const SequenceChunk& chunk : chunks) {
        XINFER_CHECK(!chunk.tokens.empty(), "sequence {} has no new tokens", chunk.seq);
        const int64_t kv_len = chunk.start_position + int64_t(chunk.tokens.size());
        if (!kv_.reserve(chunk.seq, kv_len))
            fail("KV cache full: sequence {} needs {} tokens; {} free pages of {} tokens in the first group", chunk.seq,
                 kv_len, kv_.free_pages(0), page_size);
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

    // Host metadata → backend tensors in the step workspace. Uploads are stream-ordered, so
    // the host vectors are kept until the step's synchronize.
    workspace_.reset();
    std::vector<std::vector<int32_t>> host_metadata;
    host_metadata.reserve(4 + 2 * groups_.size());
    auto upload = [&](std::vector<int32_t> host, std::initializer_list<int64_t> dims) {
        Tensor t = workspace_.make(DType::i32, dims);
        host_metadata.push_back(std::move(host));
        backend_.upload(t, host_metadata.back().data());
        return t;
    };

    ForwardBatch batch;
    batch.n_tokens = n_tokens;
    batch.token_ids = upload(token_ids, {n_tokens});
    batch.positions = upload(positions, {n_tokens});
    const int64_t n_out = int64_t(logit_rows.size());
    batch.logit_rows = upload(logit_rows, {n_out});
    Tensor cu = upload(cu_q_lens, {n_seqs + 1});
    Tensor lens = upload(kv_lens, {n_seqs});
    for (size_t g = 0; g < groups_.size(); ++g) {
        size_t max_pages = 1;
        for (const SequenceChunk& chunk : chunks) max_pages = std::max(max_pages, kv_.pages(chunk.seq, int(g)).size());
        std::vector<int32_t> table(size_t(n_seqs) * max_pages, -1), slots;
        for (size_t s = 0; s < chunks.size(); ++s) {
            const std::vector<int32_t>& pages = kv_.pages(chunks[s].seq, int(g));
            std::copy(pages.begin(), pages.end(), table.begin() + long(s * max_pages));
            for (size_t i = 0; i < chunks[s].tokens.size(); ++i) {
                const int64_t pos = chunks[s].start_position + int64_t(i);
                slots.push_back(pages[size_t(pos / page_size)] * page_size + int32_t(pos % page_size));
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
        batch.groups.push_back(group);
    }
    batch.layer_group = layer_group_;
    batch.caches = caches_;
    batch.tap = tap;

    const int64_t vocab = model_.config().vocab_size;
    Tensor logits = workspace_.make(DType::f32, {n_out, vocab});
    model_.forward(batch, logits);
    std::vector<float> host(size_t(logits.numel()));
    backend_.download(logits, host.data());
    backend_.synchronize();
    return host;
}

}  // namespace xinfer
