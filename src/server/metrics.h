// The body of GET /metrics: the engine's state and counters in the Prometheus text exposition
// format (0.0.4) under vLLM's metric names, so dashboards and alerts written for vLLM read xinfer
// unchanged. Counters carry the `_total` suffix on their samples, as Prometheus clients write them;
// every sample has the model_name label.
#pragma once

#include "xinfer/engine.h"

#include <cstdint>
#include <map>
#include <string>

namespace xinfer {

// Request-level counters the server keeps (vLLM's vllm:prompt_tokens, vllm:generation_tokens and
// vllm:request_success, the last by finished_reason).
struct RequestCounters {
    int64_t prompt_tokens = 0;
    int64_t generation_tokens = 0;
    std::map<std::string, int64_t> finished;  // finish reason ("stop", "length", "abort") → requests
};

std::string prometheus_metrics(const EngineStats& stats, const std::string& model_name,
                               const RequestCounters* requests = nullptr);

}  // namespace xinfer
