#include "runtime/profiler.h"

#include "backend/op_desc.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>

namespace xinfer {
namespace {

double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Profiler::Profiler(Backend& backend) : backend_(backend) {
    // Device events bracket each op: the start event is recorded by the observer of the
    // previous op (or at begin), so one event per op suffices.
    if (backend_.has_events()) pending_start_ = backend_.event_record();
    backend_.set_op_observer([this](const xinfer_op& op, double start, double end) {
        OpRecord record{op.type, op.layer, describe_op(op), op_bytes(op), start, end};
        if (backend_.has_events()) {
            record.event_start = pending_start_;
            record.event_end = backend_.event_record();
            pending_start_ = record.event_end;
        }
        ops_.push_back(std::move(record));
    });
}

Profiler::~Profiler() {
    stop();
    for (OpRecord& op : ops_) {
        if (op.event_start) backend_.event_destroy(op.event_start);
    }
    if (pending_start_) backend_.event_destroy(pending_start_);
}

void Profiler::stop() {
    if (!active_) return;
    backend_.set_op_observer(nullptr);
    active_ = false;
}

void Profiler::begin_region(const std::string& name) { regions_.push_back({name, now_us(), -1}); }
void Profiler::end_region() {
    for (auto it = regions_.rbegin(); it != regions_.rend(); ++it)
        if (it->end_us < 0) {
            it->end_us = now_us();
            return;
        }
}

void Profiler::resolve_device_times() {
    if (!backend_.has_events()) return;
    backend_.synchronize();
    for (OpRecord& op : ops_)
        if (op.device_us < 0 && op.event_start && op.event_end)
            op.device_us = 1000.0 * backend_.event_elapsed_ms(op.event_start, op.event_end);
}

void Profiler::write_chrome_trace(const std::filesystem::path& path) {
    resolve_device_times();
    nlohmann::json events = nlohmann::json::array();
    const double t0 = ops_.empty() ? 0 : ops_.front().host_start_us;
    auto meta = [&](int tid, const std::string& name) {
        events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", 1}, {"tid", tid}, {"args", {{"name", name}}}});
    };
    meta(1, "host: op issue");
    meta(2, "regions");
    if (backend_.has_events()) meta(3, "device: " + backend_.name());
    double device_clock = 0;  // device events are durations: laid end to end from the first op
    for (const OpRecord& op : ops_) {
        const std::string name = op.layer >= 0 ? fmt::format("{} L{}", op_type_name(op.type), op.layer)
                                               : std::string(op_type_name(op.type));
        nlohmann::json args = {{"op", op.description}, {"layer", op.layer}, {"bytes", op.bytes}};
        events.push_back({{"ph", "X"}, {"name", name}, {"cat", "op"}, {"pid", 1}, {"tid", 1},
                          {"ts", op.host_start_us - t0}, {"dur", op.host_end_us - op.host_start_us}, {"args", args}});
        if (op.device_us >= 0) {
            device_clock = std::max(device_clock, op.host_start_us - t0);
            events.push_back({{"ph", "X"}, {"name", name}, {"cat", "device"}, {"pid", 1}, {"tid", 3},
                              {"ts", device_clock}, {"dur", op.device_us}, {"args", args}});
            device_clock += op.device_us;
        }
    }
    for (const Region& r : regions_)
        events.push_back({{"ph", "X"}, {"name", r.name}, {"cat", "region"}, {"pid", 1}, {"tid", 2},
                          {"ts", r.start_us - t0}, {"dur", (r.end_us < 0 ? now_us() : r.end_us) - r.start_us}});
    std::ofstream out(path);
    if (!out) fail("profiler: cannot write {}", path.string());
    out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

std::string Profiler::summary() {
    resolve_device_times();
    struct Totals {
        int calls = 0;
        double us = 0;
        uint64_t bytes = 0;
    };
    std::map<std::string, Totals> by_type;
    double total_us = 0;
    for (const OpRecord& op : ops_) {
        const double us = op.device_us >= 0 ? op.device_us : op.host_end_us - op.host_start_us;
        Totals& t = by_type[op_type_name(op.type)];
        ++t.calls;
        t.us += us;
        t.bytes += op.bytes;
        total_us += us;
    }
    std::vector<std::pair<std::string, Totals>> rows(by_type.begin(), by_type.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.us > b.second.us; });
    std::string text = fmt::format("{:<12} {:>7} {:>10} {:>6} {:>8}\n", "op", "calls", "total ms", "share", "GB/s");
    for (const auto& [name, t] : rows)
        text += fmt::format("{:<12} {:>7} {:>10.3f} {:>5.1f}% {:>8.2f}\n", name, t.calls, t.us / 1000,
                            100 * t.us / std::max(total_us, 1e-9), double(t.bytes) / std::max(t.us, 1e-9) / 1e3);
    return text;
}

}  // namespace xinfer
