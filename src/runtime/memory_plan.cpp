#include "runtime/memory_plan.h"

#include "spec/dflash.h"

#include "core/status.h"

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>

namespace xinfer {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// KV heads one rank holds: heads are split across ranks; with fewer heads than ranks each rank
// keeps one (replicated), as vLLM does.
int kv_heads_per_rank(int n_kv_heads, int tp) { return std::max(1, int(ceil_div(n_kv_heads, tp))); }

std::string bytes_text(double bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int unit = 0;
    while (std::fabs(bytes) >= 1024 && unit < 4) bytes /= 1024, ++unit;
    return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[unit]);
}

std::string with_commas(int64_t value) {
    std::string digits = std::to_string(value < 0 ? -value : value), out;
    for (size_t i = 0; i < digits.size(); ++i) {
        if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
    }
    return value < 0 ? "-" + out : out;
}

struct WeightTally {
    std::map<DType, WeightLine> lines;
    double decode_bytes = 0;  // per rank, read by a batch-1 decode step
    // `elements_per_rank` of dtype; `read_fraction` of them read per decode token.
    void add(DType dtype, double elements_per_rank, bool replicated, double read_fraction = 1) {
        WeightLine& line = lines[dtype];
        line.dtype = dtype;
        const uint64_t bytes = uint64_t(elements_per_rank * double(dtype_size(dtype)));
        (replicated ? line.replicated : line.sharded) += bytes;
        decode_bytes += double(bytes) * read_fraction;
    }
};

// Weights per rank as the decoder loads them (src/models/decoder.cpp): matrices in weight_dtype
// (or, with fp8_weights, those the config quantizes in e4m3 plus one f32 scale per block), norms,
// routers and sinks in f32. Sharded over tensor_parallel_size: attention heads, experts, dense
// FFN, the (vocab-parallel) embedding and lm_head. Replicated: norms and routers.
WeightTally tally_weights(const ModelConfig& config, const PlanOptions& options) {
    const double tp = options.tensor_parallel_size, hidden = double(config.hidden_size);
    const DType w = options.weight_dtype;
    const Fp8WeightConfig& fp8 = config.fp8;
    WeightTally tally;
    // `count` matrices [rows, cols] named `name`, `share` of them on this rank.
    auto matrix = [&](const std::string& name, double rows, double cols, double share, double read_fraction = 1) {
        if (!(options.fp8_weights && fp8.quantizes(name))) {
            tally.add(w, rows * cols * share, false, read_fraction);
            return;
        }
        const double blocks = std::ceil(rows / double(fp8.block_rows)) * std::ceil(cols / double(fp8.block_cols));
        tally.add(DType::f8_e4m3, rows * cols * share, false, read_fraction);
        tally.add(DType::f32, blocks * share, false, read_fraction);
    };
    const double vocab_share = double(config.vocab_size) / tp;
    if (config.tie_word_embeddings) {
        tally.add(w, vocab_share * hidden, false);  // embedding = lm_head: read whole for the logits
    } else {
        tally.add(w, vocab_share * hidden, false, 1.0 / vocab_share);  // embedding: one row per token
        tally.add(w, vocab_share * hidden, false);                     // lm_head
    }
    tally.add(DType::f32, hidden, true);  // final norm
    for (size_t i = 0; i < config.layers.size(); ++i) {
        const LayerSpec& l = config.layers[i];
        const std::string p = "model.layers." + std::to_string(i) + ".";
        const double kv_heads = kv_heads_per_rank(l.n_kv_heads, options.tensor_parallel_size);
        const double q_share = 1 / tp;
        tally.add(DType::f32, 2 * hidden + (config.qk_norm ? 2 * l.head_dim_k : 0), true);
        matrix(p + "self_attn.q_proj.weight", double(l.n_q_heads) * l.head_dim_k, hidden, q_share);
        matrix(p + "self_attn.k_proj.weight", kv_heads * l.head_dim_k, hidden, 1);
        matrix(p + "self_attn.v_proj.weight", kv_heads * l.head_dim_v, hidden, 1);
        matrix(p + "self_attn.o_proj.weight", hidden, double(l.n_q_heads) * l.head_dim_v, q_share);
        if (l.has_sinks) tally.add(DType::f32, double(l.n_q_heads) / tp, false);
        if (l.ffn == FfnKind::dense) {
            const double inter = double(config.intermediate_size);
            matrix(p + "mlp.gate_proj.weight", inter, hidden, 1 / tp);
            matrix(p + "mlp.up_proj.weight", inter, hidden, 1 / tp);
            matrix(p + "mlp.down_proj.weight", hidden, inter, 1 / tp);
        } else {
            tally.add(DType::f32, double(config.n_experts) * hidden + (config.router_bias ? config.n_experts : 0), true);
            const double inter = double(config.moe_intermediate_size), experts = config.n_experts / tp;
            // A batch-1 token reads top_k of the experts (of the rank's share).
            const double read = double(config.router.top_k) / double(config.n_experts);
            const std::string e = p + "mlp.experts.0.";
            matrix(e + "gate_proj.weight", inter, hidden, experts, read);
            matrix(e + "up_proj.weight", inter, hidden, experts, read);
            matrix(e + "down_proj.weight", hidden, inter, experts, read);
        }
    }
    return tally;
}

// The step's activation peak. The decoder's workspace is reset once per forward, so every
// per-layer tensor of a step stays allocated until the next: the sum over layers is the peak.
uint64_t workspace_estimate(const ModelConfig& config, const PlanOptions& options, int64_t logit_rows,
                            size_t n_groups, std::string& formula) {
    const double T = double(options.max_num_batched_tokens), a = double(dtype_size(options.activation_dtype));
    const double tp = options.tensor_parallel_size, hidden = double(config.hidden_size);
    double stream = 3 * T * hidden * a;  // residual, normed, block_out
    double layers = 0, moe_internal = 0;
    for (const LayerSpec& l : config.layers) {
        const double q_heads = l.n_q_heads / tp, kv = kv_heads_per_rank(l.n_kv_heads, options.tensor_parallel_size);
        layers += T * a * (q_heads * l.head_dim_k + kv * (l.head_dim_k + l.head_dim_v) + q_heads * l.head_dim_v);
        if (l.ffn == FfnKind::dense) {
            layers += T * a * 3 * double(config.intermediate_size) / tp;  // gate_up + activated
        } else {
            const double k = config.router.top_k;
            layers += T * (double(config.n_experts) * 4 + 2 * k * 4);  // router logits f32, ids, weights
            // The largest expert path (the CUDA plugin's per-expert GEMMs for a prefill chunk): per
            // (token, slot) pair, gathered rows then the swiglu output (bf16, max(hidden, inter)
            // wide), gate_up (bf16, 2·inter), the down output (f32, hidden) and two indices; plus one
            // expert's gate_up widened to bf16 when FP8 experts run that way.
            const double inter = double(config.moe_intermediate_size) / tp;
            moe_internal = std::max(moe_internal, T * k * (2 * std::max(hidden, inter) + 4 * inter + 4 * hidden + 8) +
                                                      4 * inter * hidden);
        }
    }
    const double logits = double(logit_rows) * (double(config.vocab_size) * 4 + hidden * a);
    const double metadata = T * 4 * double(3 + 2 * n_groups);
    formula = fmt::format(
        "T = max_num_batched_tokens = {}, a = {} B: 3·T·hidden·a (residual stream) {} + Σ_layers T·a·(q+k+v+attn "
        "widths) + T·a·3·ffn_width (dense) or T·(4·E + 8·top_k) (MoE routing) {} + MoE expert buffers "
        "T·top_k·(2·max(hidden, moe_inter) + 4·moe_inter + 4·hidden + 8) + 4·moe_inter·hidden {} + logits rows "
        "{}·(vocab·4 + hidden·a) {} + step metadata {}",
        options.max_num_batched_tokens, a, bytes_text(stream), bytes_text(layers), bytes_text(moe_internal),
        logit_rows, bytes_text(logits), bytes_text(metadata));
    return uint64_t(stream + layers + moe_internal + logits + metadata);
}

// Largest x in [lo, hi] with ok(x), given ok is monotone (true then false); lo - 1 if none.
template <typename Ok>
int64_t largest(int64_t lo, int64_t hi, Ok ok) {
    int64_t best = lo - 1;
    while (lo <= hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (ok(mid)) best = mid, lo = mid + 1;
        else hi = mid - 1;
    }
    return best;
}

}  // namespace

int64_t max_pages_per_sequence(const KvLayout& layout, int64_t n_tokens, int64_t chunk) {
    int64_t pages = 0;
    for (size_t g = 0; g < layout.groups.size(); ++g) {
        const KvGroupLayout& group = layout.groups[g];
        int64_t group_pages = layout.pages_for(int(g), n_tokens);
        // A chunk of q tokens after `committed` needs keys [committed - window + 1, committed + q):
        // a span of window - 1 + q tokens touches at most ceil(span / tokens_per_page) + 1 pages.
        if (group.sliding)
            group_pages = std::min(
                group_pages, ceil_div(group.window - 1 + std::min(chunk, n_tokens), group.tokens_per_page) + 1);
        pages += group_pages;
    }
    return pages;
}

int64_t max_sequence_tokens(const KvLayout& layout, int64_t n_pages, int64_t chunk) {
    return largest(0, int64_t(1) << 40, [&](int64_t n) { return max_pages_per_sequence(layout, n, chunk) <= n_pages; });
}

uint64_t parse_memory_size(const std::string& text) {
    size_t end = 0;
    double value = 0;
    try {
        value = std::stod(text, &end);
    } catch (const std::exception&) {
        fail("memory size \"{}\": expected a number with an optional suffix (GiB, MiB, KiB, GB, MB, KB, B)", text);
    }
    std::string suffix = text.substr(end);
    while (!suffix.empty() && suffix.front() == ' ') suffix.erase(suffix.begin());
    for (char& c : suffix) c = char(std::tolower(static_cast<unsigned char>(c)));
    const std::map<std::string, double> units = {{"", 1},         {"b", 1},       {"kib", 1024.0}, {"mib", 1048576.0},
                                                 {"gib", 1 << 30}, {"tib", 1099511627776.0},       {"kb", 1e3},
                                                 {"mb", 1e6},      {"gb", 1e9},    {"tb", 1e12},    {"k", 1024.0},
                                                 {"m", 1048576.0}, {"g", 1 << 30}};
    auto it = units.find(suffix);
    if (it == units.end() || value < 0)
        fail("memory size \"{}\": unknown suffix \"{}\" (expected GiB, MiB, KiB, GB, MB, KB, B or none)", text, suffix);
    return uint64_t(value * it->second);
}

MemoryPlan plan_memory(const ModelConfig& config, const PlanOptions& options) {
    XINFER_CHECK(options.tensor_parallel_size >= 1 && options.max_num_seqs >= 1 && options.max_num_batched_tokens >= 1,
                 "plan: tensor_parallel_size {}, max_num_seqs {}, max_num_batched_tokens {} must be positive",
                 options.tensor_parallel_size, options.max_num_seqs, options.max_num_batched_tokens);
    MemoryPlan plan;
    plan.options = options;
    plan.max_model_len = options.max_model_len > 0 ? options.max_model_len : config.max_position_embeddings;
    XINFER_CHECK(plan.max_model_len > 0, "plan: max_model_len unknown (config has no max_position_embeddings)");
    const int tp = options.tensor_parallel_size;
    const int S = options.max_num_seqs;

    const WeightTally tally = tally_weights(config, options);
    for (const auto& [dtype, line] : tally.lines) {
        plan.weights.push_back(line);
        plan.weight_bytes += line.sharded + line.replicated;
    }
    plan.decode_weight_bytes = uint64_t(tally.decode_bytes);

    // KV layout per rank: each group keeps its geometry with the rank's share of KV heads.
    std::vector<KvGroupShape> shapes;
    for (const KvGroupSpec& spec : kv_groups_for(config))
        shapes.push_back({spec.kind == AttentionKind::sliding, spec.window, kv_heads_per_rank(spec.n_kv_heads, tp),
                          spec.head_dim_k, spec.head_dim_v, spec.layers});
    plan.layout = make_kv_layout(shapes, options.kv_dtype, options.min_tokens_per_page);
    for (const KvGroupLayout& group : plan.layout.groups) {
        KvGroupPlan g;
        g.sliding = group.sliding;
        g.window = group.window;
        g.n_layers = int(group.layers.size());
        g.n_kv_heads_per_rank = group.n_kv_heads;
        g.bytes_per_token = group.bytes_per_token;
        g.tokens_per_page = group.tokens_per_page;
        if (group.sliding) {
            g.window_bytes = group.window * group.bytes_per_token;
            g.window_pages = ceil_div(group.window, group.tokens_per_page) + 1;  // decode: chunk of 1
            plan.sliding_bytes_per_seq += g.window_bytes;
            plan.sliding_pages_per_seq += g.window_pages;
        } else {
            plan.full_bytes_per_token += group.bytes_per_token;
        }
        plan.groups.push_back(g);
    }

    // Speculation: verification rows count against max_num_batched_tokens (no extra
    // activations) but every sequence may ask for 1 + k logits rows; MTP adds its blocks.
    const SpeculativeConfig spec = parse_speculative_config(options.speculative_config);
    const int64_t logit_rows = int64_t(S) * (1 + spec.num_speculative_tokens);
    if (spec.method == "mtp") {
        // Each MTP block is a sliding-window attention layer plus a dense MLP (research/mimo_v2_flash.md §5).
        const KvGroupShape* sliding = nullptr;
        for (const KvGroupShape& s : shapes)
            if (s.sliding) sliding = &s;
        const KvGroupShape& shape = sliding ? *sliding : shapes.front();
        const int window = sliding ? shape.window : int(std::min<int64_t>(plan.max_model_len, 128));
        const double layer_kv = double(
            kv_bytes_per_token_per_layer(options.kv_dtype, shape.n_kv_heads, shape.head_dim_k, shape.head_dim_v));
        const LayerSpec& l = config.layers.back();
        const double block_weights = double(config.hidden_size) *
                                     (double(l.n_q_heads) * (l.head_dim_k + l.head_dim_v) / tp +
                                      double(shape.n_kv_heads) * (shape.head_dim_k + shape.head_dim_v) +
                                      3.0 * double(config.intermediate_size) / tp) *
                                     double(dtype_size(options.weight_dtype));
        const int blocks = spec.num_speculative_tokens;
        plan.speculative_bytes = uint64_t(blocks * (block_weights + S * window * layer_kv));
        plan.speculative_note = fmt::format(
            "mtp, {} tokens: {} MTP blocks (sliding attention + dense MLP weights {} each, KV {} tokens × {} B per "
            "sequence), {} logits rows per sequence",
            blocks, blocks, bytes_text(block_weights), window, int64_t(layer_kv), 1 + blocks);
    } else if (spec.method == "dflash") {
        // The drafter's own layers and fc (embedding and lm_head are the target's), and its KV:
        // every layer caches every sequence's context plus one block (src/spec/dflash.h).
        const DFlashConfig d = read_dflash_config(*Checkpoint::open(spec.model, /*load_weights=*/false), config,
                                                  /*load_sidecar=*/false);
        const double H = double(d.hidden_size), qkv = double(d.n_q_heads + 2 * d.n_kv_heads) * d.head_dim;
        const double layer = H * (qkv + double(d.n_q_heads) * d.head_dim + 3.0 * double(d.intermediate_size));
        const double fc = double(d.target_layer_ids.size()) * double(d.target_hidden_size) * H;
        const double weights = (double(d.layers.size()) * layer + fc) * double(dtype_size(options.weight_dtype));
        // The drafter's KV pool as the drafter sizes it (one group per window; sliding groups hold
        // each sequence's last window plus one step's rows).
        std::vector<KvGroupShape> groups;
        for (size_t i = 0; i < d.layers.size(); ++i) {
            const int window = d.layers[i].window;
            auto it = std::find_if(groups.begin(), groups.end(), [&](const KvGroupShape& g) { return g.window == window; });
            if (it == groups.end()) it = groups.insert(groups.end(), {window > 0, window, d.n_kv_heads, d.head_dim, d.head_dim, {}});
            it->layers.push_back(int(i));
        }
        const KvLayout drafter_layout = make_kv_layout(groups, options.activation_dtype, kDFlashMinTokensPerPage);
        const int64_t pages = dflash_kv_pages(drafter_layout, S, plan.max_model_len, d.block_size,
                                              options.max_num_batched_tokens);
        const double kv = double(pages) * double(drafter_layout.page_bytes);
        plan.speculative_bytes = uint64_t(weights + kv);
        plan.speculative_note = fmt::format(
            "dflash, {} tokens: drafter weights {} ({} layers, hidden {}), drafter KV {} ({} pages of {} B for {} "
            "sequences), {} logits rows per sequence",
            spec.num_speculative_tokens, bytes_text(weights), d.layers.size(), d.hidden_size, bytes_text(kv), pages,
            drafter_layout.page_bytes, S, 1 + spec.num_speculative_tokens);
    } else if (!spec.method.empty()) {  // ngram: no model
        plan.speculative_note = fmt::format("{}, {} tokens: {} logits rows per sequence", spec.method,
                                            spec.num_speculative_tokens, 1 + spec.num_speculative_tokens);
    }
    plan.workspace_bytes =
        workspace_estimate(config, options, logit_rows, plan.layout.groups.size(), plan.workspace_formula);

    plan.budget_bytes = uint64_t(double(options.device_memory) * options.gpu_memory_utilization);
    const int64_t fixed = int64_t(plan.weight_bytes + plan.workspace_bytes + plan.speculative_bytes);
    plan.kv_bytes = options.kv_cache_memory > 0 ? options.kv_cache_memory : int64_t(plan.budget_bytes) - fixed;
    plan.n_pages = std::max<int64_t>(0, plan.kv_bytes) / plan.layout.page_bytes;
    plan.kv_bytes = plan.kv_bytes < 0 ? plan.kv_bytes : plan.n_pages * plan.layout.page_bytes;

    const int64_t chunk = options.max_num_batched_tokens;
    const KvLayout& layout = plan.layout;
    plan.pages_per_full_sequence = max_pages_per_sequence(layout, plan.max_model_len, chunk);
    const int64_t decode_pages_full = max_pages_per_sequence(layout, plan.max_model_len, 1);
    auto fits_pages = [&](int64_t first_sequence_pages, int64_t n_seqs) {
        return first_sequence_pages + (n_seqs - 1) * plan.sliding_pages_per_seq <= plan.n_pages;
    };
    // Full-group pages left once max_num_seqs windows are reserved, as tokens.
    const int64_t free_for_full = plan.n_pages - int64_t(S) * plan.sliding_pages_per_seq;
    plan.capacity_tokens = free_for_full < 0 ? 0 : largest(0, int64_t(1) << 40, [&](int64_t n) {
        int64_t pages = 0;
        for (size_t g = 0; g < layout.groups.size(); ++g)
            if (!layout.groups[g].sliding) pages += layout.pages_for(int(g), n);
        return pages <= free_for_full;
    });
    plan.full_length_sequences = decode_pages_full > 0 ? plan.n_pages / decode_pages_full : 0;

    const bool weights_fit = options.kv_cache_memory > 0 || int64_t(plan.budget_bytes) >= fixed;
    plan.fits = weights_fit && plan.n_pages > 0 && fits_pages(plan.pages_per_full_sequence, S);
    if (plan.fits) {
        plan.verdict = fmt::format("fits: {} full-length ({} tokens) sequences at once; {} sequences of {} tokens "
                                   "on average with max_num_seqs = {}",
                                   plan.full_length_sequences, plan.max_model_len, S,
                                   std::min(plan.max_model_len, plan.capacity_tokens / S), S);
    } else if (!weights_fit) {
        // Smallest tensor-parallel size whose per-rank weights + workspace leave room for one sequence.
        int needed = 0;
        for (int t = tp + 1; t <= 64 && needed == 0; ++t) {
            PlanOptions wider = options;
            wider.tensor_parallel_size = t;
            if (plan_memory(config, wider).fits) needed = t;
        }
        plan.verdict = fmt::format(
            "does NOT fit: weights {} + workspace {} + speculative {} per rank exceed the budget {} ({} × {:.2f}); {}",
            bytes_text(double(plan.weight_bytes)), bytes_text(double(plan.workspace_bytes)),
            bytes_text(double(plan.speculative_bytes)), bytes_text(double(plan.budget_bytes)),
            bytes_text(double(options.device_memory)), options.gpu_memory_utilization,
            needed ? fmt::format("--tensor-parallel-size {} would fit", needed)
                   : std::string("no tensor-parallel size up to 64 fits"));
    } else {
        const int64_t best_len = largest(1, plan.max_model_len, [&](int64_t n) {
            return fits_pages(max_pages_per_sequence(layout, n, chunk), S);
        });
        const int64_t best_seqs =
            plan.sliding_pages_per_seq == 0
                ? (plan.n_pages >= plan.pages_per_full_sequence ? S : 0)
                : (plan.n_pages >= plan.pages_per_full_sequence
                       ? 1 + (plan.n_pages - plan.pages_per_full_sequence) / plan.sliding_pages_per_seq
                       : 0);
        std::string options_text;
        if (best_len >= 1) options_text += fmt::format("--max-model-len {} would fit with --max-num-seqs {}", best_len, S);
        if (best_seqs >= 1)
            options_text += fmt::format("{}--max-num-seqs {} would fit with --max-model-len {}",
                                        options_text.empty() ? "" : "; ", best_seqs, plan.max_model_len);
        if (options_text.empty()) options_text = "no max-model-len fits: free memory or raise --gpu-memory-utilization";
        plan.verdict = fmt::format(
            "does NOT fit: the KV pool has {} pages ({}) but one {}-token sequence needs {} pages and the other {} "
            "sequences' windows {} more; {}",
            plan.n_pages, bytes_text(double(plan.kv_bytes)), plan.max_model_len, plan.pages_per_full_sequence, S - 1,
            (S - 1) * plan.sliding_pages_per_seq, options_text);
    }
    return plan;
}

uint64_t planned_device_bytes(const MemoryPlan& plan) {
    return plan.weight_bytes + plan.workspace_bytes + plan.speculative_bytes + uint64_t(std::max<int64_t>(0, plan.kv_bytes));
}

std::string free_memory_shortfall(const MemoryPlan& plan, uint64_t free_bytes) {
    const uint64_t needed = planned_device_bytes(plan);
    if (needed <= free_bytes) return {};
    const PlanOptions& o = plan.options;
    const uint64_t fixed = needed - uint64_t(std::max<int64_t>(0, plan.kv_bytes));
    std::string advice;
    if (fixed >= free_bytes) {
        advice = "not even the weights and workspace fit: free memory held by other processes";
    } else if (o.kv_cache_memory > 0) {
        advice = fmt::format("a --kv-cache-memory of at most {} would fit", bytes_text(double(free_bytes - fixed)));
    } else {
        // The largest utilization (in hundredths, rounded down) whose budget is free now.
        const double fits = std::floor(100.0 * double(free_bytes) / double(o.device_memory)) / 100.0;
        advice = fmt::format("--gpu-memory-utilization {:.2f} (a {} budget) would fit what is free", fits,
                             bytes_text(fits * double(o.device_memory)));
    }
    return fmt::format("the plan needs {} on the device (weights {} + workspace {} + speculative {} + KV pool {}) "
                       "but only {} of its {} is free; {}",
                       bytes_text(double(needed)), bytes_text(double(plan.weight_bytes)),
                       bytes_text(double(plan.workspace_bytes)), bytes_text(double(plan.speculative_bytes)),
                       bytes_text(double(std::max<int64_t>(0, plan.kv_bytes))), bytes_text(double(free_bytes)),
                       bytes_text(double(o.device_memory)), advice);
}

std::string MemoryPlan::report() const {
    const PlanOptions& o = options;
    std::string out;
    auto line = [&out](const std::string& text) { out += text + "\n"; };
    line(fmt::format("device memory {} × utilization {:.2f} = budget {} per rank (tensor-parallel size {})",
                     bytes_text(double(o.device_memory)), o.gpu_memory_utilization, bytes_text(double(budget_bytes)),
                     o.tensor_parallel_size));
    line(fmt::format("max_model_len {}, max_num_seqs {}, max_num_batched_tokens {}, kv dtype {}{}", max_model_len,
                     o.max_num_seqs, o.max_num_batched_tokens, dtype_name(o.kv_dtype),
                     o.kv_dtype == DType::f8_e4m3 ? " (+ one f32 scale per token, kv head and K/V)" : ""));
    line("weights per rank:");
    for (const WeightLine& w : weights)
        line(fmt::format("  {:<8} {:>14} sharded (÷{}) + {:>12} replicated (norms, routers)", dtype_name(w.dtype),
                         bytes_text(double(w.sharded)), o.tensor_parallel_size, bytes_text(double(w.replicated))));
    line(fmt::format("  total    {:>14} ({} B){}", bytes_text(double(weight_bytes)), with_commas(int64_t(weight_bytes)),
                     o.fp8_weights ? " — FP8 matrices as e4m3 + f32 block scales" : ""));
    line(fmt::format("  read per batch-1 decode token: {} ({:.2f} GB)", bytes_text(double(decode_weight_bytes)),
                     double(decode_weight_bytes) / 1e9));
    line(fmt::format("workspace peak: {}", bytes_text(double(workspace_bytes))));
    line(fmt::format("  = {}", workspace_formula));
    if (!speculative_note.empty())
        line(fmt::format("speculative reserve: {} ({})", bytes_text(double(speculative_bytes)), speculative_note));
    line(fmt::format("KV layout: page {} B; block {} tokens", with_commas(layout.page_bytes), layout.block_tokens()));
    for (const KvGroupPlan& g : groups) {
        std::string text = fmt::format("  {:<7} {:>2} layers × {} kv heads: {} B/token, {} tokens/page",
                                       g.sliding ? "sliding" : "full", g.n_layers, g.n_kv_heads_per_rank,
                                       with_commas(g.bytes_per_token), g.tokens_per_page);
        if (g.sliding)
            text += fmt::format("; window {}: {} B per sequence exact, {} pages = {} B page-rounded", g.window,
                                with_commas(g.window_bytes), g.window_pages,
                                with_commas(g.window_pages * layout.page_bytes));
        line(text);
    }
    line(fmt::format("  growing part {} B/token; fixed sliding part {} B per sequence ({} page-rounded)",
                     with_commas(full_bytes_per_token), with_commas(sliding_bytes_per_seq),
                     with_commas(sliding_pages_per_seq * layout.page_bytes)));
    line(fmt::format("KV pool: {} ({} pages)", bytes_text(double(std::max<int64_t>(0, kv_bytes))), n_pages));
    line(fmt::format("  capacity {} tokens with {} windows reserved; {} full-length sequences; one {}-token "
                     "sequence needs {} pages (prefill chunks of {})",
                     with_commas(capacity_tokens), o.max_num_seqs, full_length_sequences, max_model_len,
                     pages_per_full_sequence, o.max_num_batched_tokens));
    line("verdict: " + verdict);
    return out;
}

}  // namespace xinfer
