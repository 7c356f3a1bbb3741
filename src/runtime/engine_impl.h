// Engine internals shared by engine.cpp (the step loop), engine_create.cpp (options → plan →
// model → engine) and in-tree users that already hold a Runner (generate(), tests).
#pragma once

#include "runtime/profiler.h"
#include "runtime/runner.h"
#include "runtime/scheduler.h"
#include "spec/drafter.h"
#include "tokenizer/bpe_encoder.h"
#include "tokenizer/detokenizer.h"
#include "xinfer/engine.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace xinfer {

struct Engine::Impl {
    // Owned parts when created from EngineOptions (destroyed in reverse: runner, model, backend).
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Checkpoint> checkpoint;
    std::unique_ptr<Model> model;
    std::unique_ptr<Runner> owned_runner;
    std::unique_ptr<Drafter> owned_drafter;

    std::unique_ptr<Detokenizer> owned_detokenizer;
    std::unique_ptr<BpeEncoder> encoder;  // from the same tokenizer.json (Engine::create)
    const Detokenizer* detokenizer = nullptr;  // the model's tokenizer.json, when it has one

    Runner* runner = nullptr;
    Drafter* drafter = nullptr;  // speculative decoding when set
    SchedulerOptions scheduler_options;
    std::unique_ptr<Scheduler> scheduler;
    std::string plan_report;

    mutable std::mutex mutex;  // scheduler, runner, pending, steps: held by step() and abort()
    std::vector<RequestOutput> pending;  // abort events, returned by the next step()
    int64_t steps = 0;
    SpecCounters spec;
    std::unique_ptr<Profiler> profiler;  // between start_profile() and stop_profile()
    bool expert_census = false;
    int64_t census_moe_layer_steps = 0, census_distinct_experts = 0;

    // Overlapped decode (vLLM's async scheduling): the next step, already queued on the device
    // behind the current one (queue_next). Its chunk i reads row rows[i] of ids.
    struct QueuedStep {
        std::vector<ScheduledChunk> plan;
        std::vector<int64_t> rows;
        Tensor ids;  // [plan rows] i32 on the device: each row's picked token
    };
    std::optional<QueuedStep> queued;
    bool overlap = false;  // EngineOptions::overlap_decode / set_overlap_decode: queue_next may run
    int64_t overlapped_steps = 0, overlap_wasted_rows = 0;

    mutable std::mutex inbox_mutex;  // submit() only takes this one, so it never waits for a step
    std::vector<std::unique_ptr<Request>> inbox;
    std::atomic<uint64_t> next_id{1};

    Impl(Runner& runner, SchedulerOptions options, Drafter* drafter);
    void drain_inbox();  // with `mutex` held
    // The drafts of each chunk of a step (empty where none), proposed for decodes with lookahead.
    std::vector<std::vector<int32_t>> propose(const std::vector<ScheduledChunk>& plan);
    // Device sampling rows for a step's chunks: chain rows argmax, the last row as the request
    // samples (draws its uniform from the request's stream, as Sampler::sample does).
    std::vector<Runner::RowSampling> sampling_rows(const std::vector<ScheduledChunk>& plan,
                                                   const std::vector<std::vector<int32_t>>& drafts);
    // When the step after `plan` is certain to be every one of its sequences decoding the token
    // `ids` (the plan's picked tokens, on the device) holds, queues that step now, fed with those
    // ids on the device, into `queued`: the device computes it while the host waits for this
    // step's ids and hands out their tokens. Called after this step's ids were queued for download.
    void queue_next(const std::vector<ScheduledChunk>& plan, const Tensor& ids);
    // Takes a finished or aborted request out of the queued step (its row is thrown away).
    void drop_queued(uint64_t id);
    // Hands the drafter the hidden states of every chunk's committed rows.
    void observe(const std::vector<ScheduledChunk>& plan, const std::vector<int64_t>& first_rows);
};

// An engine over a Runner the caller owns (it must outlive the engine). max_model_len 0: the
// longest sequence the runner's pool holds alone; larger than that is an error. With a drafter
// (caller-owned too) decodes speculate: the runner must export drafter->feature_layers(). With a
// detokenizer (caller-owned), requests may carry stop strings and finish with their text.
std::unique_ptr<Engine> make_engine(Runner& runner, SchedulerOptions options, Drafter* drafter = nullptr,
                                    const Detokenizer* detokenizer = nullptr);

}  // namespace xinfer
