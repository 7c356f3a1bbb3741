// Op-level profiler: records every op a Backend runs (type, layer, tensor shapes, bytes, host
// issue time, and device time when the backend has events) and writes Chrome Trace Event JSON
// that loads in Perfetto / chrome://tracing, plus a per-op summary table.
//
// Device timing: with events, the profiler records an event pair around each op and resolves
// them after the run (one synchronize at the end), so the device timeline shows real kernel
// durations; host-memory backends run ops synchronously, so host time is device time.
#pragma once

#include "backend/backend.h"

#include <filesystem>
#include <string>
#include <vector>

namespace xinfer {

class Profiler {
public:
    // Starts observing `backend` (replacing any other observer) until stop() or destruction.
    explicit Profiler(Backend& backend);
    ~Profiler();
    void stop();

    // Marks a region (e.g. "decode step 3") on the host timeline.
    void begin_region(const std::string& name);
    void end_region();

    void write_chrome_trace(const std::filesystem::path& path);
    // "op  calls  total ms  share  GB/s" per op type, sorted by total time.
    std::string summary();

private:
    struct OpRecord {
        int type;
        int layer;
        std::string description;
        uint64_t bytes;
        double host_start_us, host_end_us;
        void* event_start = nullptr;  // device events (backends with events only)
        void* event_end = nullptr;
        double device_us = -1;        // resolved duration
    };
    struct Region {
        std::string name;
        double start_us, end_us;
    };
    void resolve_device_times();

    Backend& backend_;
    bool active_ = true;
    std::vector<OpRecord> ops_;
    std::vector<Region> regions_;
    void* pending_start_ = nullptr;
};

}  // namespace xinfer
