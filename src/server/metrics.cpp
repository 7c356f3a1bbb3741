#include "server/metrics.h"

#include <fmt/format.h>

namespace xinfer {
namespace {

// Prometheus label values escape backslash, double quote and newline.
std::string escape_label(const std::string& value) {
    std::string out;
    for (char c : value) {
        if (c == '\\' || c == '"') out += '\\';
        out += c == '\n' ? std::string("\\n") : std::string(1, c);
    }
    return out;
}

class Exposition {
public:
    explicit Exposition(const std::string& model_name) : label_(fmt::format("model_name=\"{}\"", escape_label(model_name))) {}

    void gauge(const char* name, const char* help, double value) {
        header(name, help, "gauge");
        sample(name, "", value);
    }
    void counter(const char* name, const char* help, int64_t value) {
        header(name, help, "counter");
        sample(fmt::format("{}_total", name), "", double(value));
    }
    // One counter family with one sample per position (label position="i").
    void counter_per_position(const char* name, const char* help, const std::vector<int64_t>& values) {
        header(name, help, "counter");
        for (size_t i = 0; i < values.size(); ++i)
            sample(fmt::format("{}_total", name), fmt::format(",position=\"{}\"", i), double(values[i]));
    }
    // One counter family with one sample per label value (label `label`="key").
    void counter_by(const char* name, const char* help, const char* label, const std::map<std::string, int64_t>& values) {
        header(name, help, "counter");
        for (const auto& [key, value] : values)
            sample(fmt::format("{}_total", name), fmt::format(",{}=\"{}\"", label, escape_label(key)), double(value));
    }
    std::string text() && { return std::move(text_); }

private:
    void header(const char* name, const char* help, const char* type) {
        text_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    }
    void sample(const std::string& name, const std::string& extra_labels, double value) {
        text_ += fmt::format("{}{{{}{}}} {}\n", name, label_, extra_labels, value);
    }

    std::string label_;
    std::string text_;
};

}  // namespace

std::string prometheus_metrics(const EngineStats& stats, const std::string& model_name,
                               const RequestCounters* requests) {
    Exposition e(model_name);
    e.gauge("vllm:num_requests_running", "Requests in the running batch.", double(stats.running));
    e.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", double(stats.waiting));
    e.gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).",
            stats.kv_pages_total ? 1.0 - double(stats.kv_pages_free) / double(stats.kv_pages_total) : 0.0);
    e.counter("vllm:num_preemptions", "Requests preempted (recomputed later) because KV pages ran out.",
              stats.preemptions);
    e.counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_query_tokens);
    e.counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens);
    if (requests) {
        e.counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", requests->prompt_tokens);
        e.counter("vllm:generation_tokens", "Tokens generated for finished requests.", requests->generation_tokens);
        e.counter_by("vllm:request_success", "Finished requests by finish reason.", "finished_reason",
                     requests->finished);
    }
    if (!stats.spec_method.empty()) {
        const SpecCounters& s = stats.spec;
        e.counter("vllm:spec_decode_num_drafts", "Verify steps (draft chains).", s.num_drafts);
        e.counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_draft_tokens);
        e.counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens);
        e.counter_per_position("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted at each draft position.", s.accepted_per_position);
    }
    return std::move(e).text();
}

}  // namespace xinfer
