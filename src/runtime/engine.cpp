// The engine loop: drain submissions, schedule, one forward, sample, complete, stream.
#include "runtime/engine_impl.h"

#include "core/status.h"
#include "runtime/memory_plan.h"

#include <chrono>

namespace xinfer {
namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

RequestOutput output_of(const Request& r, std::chrono::steady_clock::time_point now) {
    RequestOutput out;
    out.id = r.id;
    out.finished = r.finished();
    if (out.finished) out.finish_reason = finish_reason_name(r.finish);
    out.prompt_tokens = r.prompt_len;
    out.cached_prompt_tokens = r.cached_prompt;
    out.generated_tokens = r.n_generated();
    out.preemptions = r.n_preemptions;
    if (r.n_generated() > 0) out.time_to_first_token_s = seconds_between(r.arrival, r.first_token);
    out.elapsed_s = seconds_between(r.arrival, now);
    return out;
}

}  // namespace

Engine::Impl::Impl(Runner& runner_, SchedulerOptions options) : runner(&runner_), scheduler_options(options) {
    const KvCacheManager& kv = runner->kv();
    const int64_t longest = max_sequence_tokens(kv.layout(), kv.n_pages(), options.max_num_batched_tokens);
    if (scheduler_options.max_model_len <= 0) scheduler_options.max_model_len = longest;
    if (scheduler_options.max_model_len > longest)
        fail("max_model_len {} does not fit the KV pool: {} pages of {} B hold one sequence of at most {} tokens "
             "(prefill chunks of {})",
             scheduler_options.max_model_len, kv.n_pages(), kv.layout().page_bytes, longest,
             options.max_num_batched_tokens);
    scheduler = std::make_unique<Scheduler>(scheduler_options, runner->kv());
}

void Engine::Impl::drain_inbox() {
    std::vector<std::unique_ptr<Request>> arrived;
    {
        std::lock_guard<std::mutex> lock(inbox_mutex);
        arrived.swap(inbox);
    }
    for (std::unique_ptr<Request>& r : arrived) scheduler->add(std::move(r));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

std::unique_ptr<Engine> make_engine(Runner& runner, SchedulerOptions options) {
    return std::make_unique<Engine>(std::make_unique<Engine::Impl>(runner, options));
}

uint64_t Engine::submit(std::vector<int32_t> prompt, const SamplingParams& sampling, int max_tokens,
                        std::vector<int32_t> stop_ids, StreamCallback callback) {
    if (prompt.empty()) fail("submit: empty prompt");
    const int64_t max_model_len = impl_->scheduler_options.max_model_len;
    if (int64_t(prompt.size()) >= max_model_len)
        fail("submit: prompt of {} tokens leaves no room for a generated token within max_model_len {}", prompt.size(),
             max_model_len);
    if (max_tokens < 1) fail("submit: max_tokens must be >= 1, got {}", max_tokens);
    const int64_t vocab = impl_->runner->model().config().vocab_size;
    for (int32_t token : prompt)
        if (token < 0 || token >= vocab) fail("submit: token id {} outside the vocabulary [0, {})", token, vocab);
    const uint64_t id = impl_->next_id.fetch_add(1);
    XINFER_CHECK(id < (uint64_t(1) << 31), "request ids exhausted");
    auto request = std::make_unique<Request>(id, std::move(prompt), sampling, max_tokens);
    request->stop_ids = std::move(stop_ids);
    request->callback = std::move(callback);
    std::lock_guard<std::mutex> lock(impl_->inbox_mutex);
    impl_->inbox.push_back(std::move(request));
    return id;
}

bool Engine::abort(uint64_t id) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->drain_inbox();  // a request submitted a moment ago is abortable too
    std::unique_ptr<Request> request = impl_->scheduler->abort(id);  // frees its pages now
    if (!request) return false;
    RequestOutput out = output_of(*request, std::chrono::steady_clock::now());
    if (request->callback) request->callback(out);
    impl_->pending.push_back(std::move(out));
    return true;
}

std::vector<RequestOutput> Engine::step() {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    Impl& e = *impl_;
    e.drain_inbox();
    std::vector<RequestOutput> outputs;
    outputs.swap(e.pending);
    const std::vector<ScheduledChunk> plan = e.scheduler->schedule();
    if (plan.empty()) return outputs;

    std::vector<SequenceChunk> chunks;
    chunks.reserve(plan.size());
    for (const ScheduledChunk& c : plan)
        chunks.push_back({int(c.request->id), c.start,
                          std::span<const int32_t>(c.request->tokens).subspan(size_t(c.start), size_t(c.count)), false});
    const std::vector<float> logits = e.runner->forward(chunks);
    ++e.steps;

    // One logits row per chunk; only chunks that reach the end of their known tokens sample.
    const size_t vocab = size_t(e.runner->model().config().vocab_size);
    const auto now = std::chrono::steady_clock::now();
    std::vector<int32_t> sampled(plan.size(), -1);
    for (size_t i = 0; i < plan.size(); ++i) {
        if (!plan[i].samples) continue;
        Request& r = *plan[i].request;
        sampled[i] = r.sampler.sample(std::span(logits).subspan(i * vocab, vocab));
        r.tokens.push_back(sampled[i]);
        if (r.n_generated() == 1) r.first_token = now;
        r.last_token = now;
    }
    // complete() commits the computed tokens, decides stop/length, and hands back finished
    // requests (kept alive here until their outputs are built).
    const std::vector<std::unique_ptr<Request>> finished = e.scheduler->complete(plan);
    for (size_t i = 0; i < plan.size(); ++i) {
        if (sampled[i] < 0) continue;
        const Request& r = *plan[i].request;
        RequestOutput out = output_of(r, now);
        out.new_tokens.push_back(sampled[i]);
        if (r.callback) r.callback(out);
        outputs.push_back(std::move(out));
    }
    return outputs;
}

bool Engine::has_work() const {
    {
        std::lock_guard<std::mutex> lock(impl_->inbox_mutex);
        if (!impl_->inbox.empty()) return true;
    }
    std::lock_guard<std::mutex> lock(impl_->mutex);
    return !impl_->pending.empty() || !impl_->scheduler->idle();
}

EngineStats Engine::stats() const {
    EngineStats s;
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const KvCacheManager& kv = impl_->runner->kv();
    s.steps = impl_->steps;
    s.preemptions = impl_->scheduler->n_preemptions();
    s.prefix_query_tokens = kv.prefix_queries();
    s.prefix_hit_tokens = kv.prefix_hits();
    s.running = int64_t(impl_->scheduler->n_running());
    s.waiting = int64_t(impl_->scheduler->n_waiting());
    {
        std::lock_guard<std::mutex> inbox_lock(impl_->inbox_mutex);
        s.waiting += int64_t(impl_->inbox.size());
    }
    s.kv_pages_total = kv.n_pages();
    s.kv_pages_free = kv.free_pages();
    s.max_model_len = impl_->scheduler_options.max_model_len;
    return s;
}

const std::string& Engine::plan_report() const { return impl_->plan_report; }

}  // namespace xinfer
