// The body of GET /metrics: the engine's state and counters in the Prometheus text exposition
// format (0.0.4) under vLLM's metric names, so dashboards and alerts written for vLLM read xinfer
// unchanged. Counters carry the `_total` suffix on their samples, as Prometheus clients write them;
// every sample has the model_name label.
#pragma once

#include "xinfer/engine.h"

#include <string>

namespace xinfer {

std::string prometheus_metrics(const EngineStats& stats, const std::string& model_name);

}  // namespace xinfer
