// The engine loop: drain submissions, schedule, one forward, sample, complete, stream.
#include "runtime/engine_impl.h"

#include "core/status.h"
#include "runtime/memory_plan.h"
#include "spec/verify.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

namespace xinfer {
namespace {

// A profiled step's region on the trace: "step N: S seqs, T tokens (D decoding)".
class ProfileRegion {
public:
    ProfileRegion(Profiler* profiler, int64_t step, const std::vector<ScheduledChunk>& plan) : profiler_(profiler) {
        if (!profiler_) return;
        int64_t tokens = 0, decoding = 0;
        for (const ScheduledChunk& c : plan) {
            tokens += c.count;
            decoding += c.samples && c.count == 1;
        }
        profiler_->begin_region(fmt::format("step {}: {} seqs, {} tokens ({} decoding)", step, plan.size(), tokens, decoding));
    }
    ~ProfileRegion() {
        if (profiler_) profiler_->end_region();
    }
    ProfileRegion(const ProfileRegion&) = delete;
    ProfileRegion& operator=(const ProfileRegion&) = delete;

private:
    Profiler* profiler_;
};

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

// Takes the request's new text (Request::take_text), so call it once per output.
RequestOutput output_of(Request& r, std::chrono::steady_clock::time_point now) {
    RequestOutput out;
    out.id = r.id;
    out.finished = r.finished();
    if (out.finished) out.finish_reason = finish_reason_name(r.finish);
    out.prompt_tokens = r.prompt_len;
    out.cached_prompt_tokens = r.cached_prompt;
    out.generated_tokens = r.n_generated();
    out.preemptions = r.n_preemptions;
    out.spec = r.spec;
    if (r.n_generated() > 0) out.time_to_first_token_s = seconds_between(r.arrival, r.first_token);
    out.elapsed_s = seconds_between(r.arrival, now);
    if (r.detokenizer) out.text = r.take_text();
    return out;
}

// The tokens a sampling chunk adds to its request: one sampled token, or — for a verify chain
// [anchor, d1 … dk] with logits rows 0..k — the accepted drafts and the target's next token
// (`accepted` is then set, else left -1). Stop ids, max_tokens and max_model_len may end the
// request inside the chain; what follows is dropped.
// `logits` are the chunk's rows, or empty when the step picked tokens on the device: then
// `device_tokens` holds each row's pick (the sampled token, or the argmax of every chain row).
std::vector<int32_t> emit_tokens(Request& r, std::span<const float> logits, std::span<const int32_t> device_tokens,
                                 int64_t vocab, const std::vector<int32_t>& drafts, int64_t max_model_len,
                                 int& accepted) {
    std::vector<int32_t> tokens;
    if (drafts.empty()) {
        tokens = {logits.empty() ? device_tokens[0] : r.sampler.sample(logits)};
    } else {
        const Verdict verdict = logits.empty() ? verify_greedy_ids(device_tokens, drafts)
                                               : verify_drafts(logits, vocab, drafts, r.sampler);
        accepted = verdict.accepted;
        tokens.assign(drafts.begin(), drafts.begin() + verdict.accepted);
        tokens.push_back(verdict.next_token);
        r.spec.add(drafts, verdict.accepted);
    }
    size_t kept = 0;
    while (kept < tokens.size() && r.append_generated(tokens[kept], max_model_len)) ++kept;
    tokens.resize(std::min(tokens.size(), kept + 1));
    return tokens;
}

}  // namespace

Engine::Impl::Impl(Runner& runner_, SchedulerOptions options, Drafter* drafter_)
    : runner(&runner_), drafter(drafter_), scheduler_options(options) {
    if (drafter) {
        scheduler_options.num_lookahead_tokens = drafter->num_speculative_tokens();
        scheduler_options.prefix_cache_holdback = std::max<int64_t>(0, drafter->context_window());
        scheduler_options.prefix_cache_alignment = drafter->prefix_cache_block();
    }
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

std::unique_ptr<Engine> make_engine(Runner& runner, SchedulerOptions options, Drafter* drafter,
                                    const Detokenizer* detokenizer) {
    auto impl = std::make_unique<Engine::Impl>(runner, options, drafter);
    impl->detokenizer = detokenizer;
    return std::make_unique<Engine>(std::move(impl));
}

std::vector<std::vector<int32_t>> Engine::Impl::propose(const std::vector<ScheduledChunk>& plan) {
    std::vector<std::vector<int32_t>> drafts(plan.size());
    if (!drafter) return drafts;
    std::vector<DraftRequest> requests;
    std::vector<size_t> chunk_of;
    for (size_t i = 0; i < plan.size(); ++i) {
        if (plan[i].lookahead <= 0) continue;
        requests.push_back({int(plan[i].request->id), plan[i].request->tokens, plan[i].lookahead});
        chunk_of.push_back(i);
    }
    if (requests.empty()) return drafts;
    std::vector<std::vector<int32_t>> proposed = drafter->propose(requests);
    XINFER_CHECK(proposed.size() == requests.size(), "drafter {} returned {} proposals for {} requests",
                 drafter->method(), proposed.size(), requests.size());
    const int64_t vocab = runner->model().config().vocab_size;
    for (size_t j = 0; j < requests.size(); ++j) {
        std::vector<int32_t>& d = proposed[j];
        if (int(d.size()) > requests[j].max_drafts) d.resize(size_t(requests[j].max_drafts));
        for (int32_t token : d)
            XINFER_CHECK(token >= 0 && token < vocab, "drafter {} proposed token {} outside the vocabulary [0, {})",
                         drafter->method(), token, vocab);
        drafts[chunk_of[j]] = std::move(d);
    }
    return drafts;
}

void Engine::Impl::observe(const std::vector<ScheduledChunk>& plan, const std::vector<int64_t>& first_rows) {
    TargetHidden hidden;
    hidden.features = runner->features();
    for (size_t i = 0; i < plan.size(); ++i) {
        const ScheduledChunk& c = plan[i];
        if (c.count > 0) hidden.sequences.push_back({int(c.request->id), first_rows[i], c.start, c.count, c.request->tokens});
    }
    drafter->observe(hidden);
}

std::vector<Runner::RowSampling> Engine::Impl::sampling_rows(const std::vector<ScheduledChunk>& plan,
                                                              const std::vector<std::vector<int32_t>>& drafts) {
    std::vector<Runner::RowSampling> rows;
    for (size_t i = 0; i < plan.size(); ++i) {
        rows.resize(rows.size() + drafts[i].size());  // chain rows: argmax
        Runner::RowSampling last;
        Sampler& sampler = plan[i].request->sampler;
        if (plan[i].samples && !sampler.greedy())
            last = {sampler.params().temperature, sampler.params().top_p, int32_t(sampler.params().top_k),
                    sampler.uniform()};
        rows.push_back(last);
    }
    return rows;
}

void Engine::Impl::queue_next(const std::vector<ScheduledChunk>& plan, const Tensor& ids) {
    // Only where nothing the host learns from this step's tokens could change the next plan but
    // a request's stop (its row of the queued step is then thrown away): plain sampled decodes,
    // nobody waiting to be admitted, no length limit reached, no drafter, profiler or census.
    if (!overlap || drafter || profiler || expert_census || !runner->backend().has_async_downloads()) return;
    if (scheduler->n_waiting() > 0 || int64_t(plan.size()) > scheduler_options.max_num_batched_tokens) return;
    // Chunk i's token must be row i of ids: not so for a queued step that lost rows (its next runs unqueued).
    if (ids.numel() != int64_t(plan.size())) return;
    {
        std::lock_guard<std::mutex> lock(inbox_mutex);
        if (!inbox.empty()) return;
    }
    const int64_t max_model_len = scheduler_options.max_model_len;
    for (const ScheduledChunk& c : plan) {
        const Request& r = *c.request;
        if (c.count != 1 || !c.samples || c.lookahead > 0 || c.start + 1 != r.n_tokens()) return;
        if (r.n_generated() + 1 >= r.max_tokens || (max_model_len > 0 && r.n_tokens() + 1 >= max_model_len)) return;
    }
    // Slots for the token being picked now (position n_tokens()); complete() keeps them (reserved).
    KvCacheManager& kv = runner->kv();
    for (const ScheduledChunk& c : plan)
        if (!kv.allocate(int(c.request->id), c.request->n_tokens() + 1)) return;  // complete() trims the others
    QueuedStep next;
    std::vector<SequenceChunk> chunks;
    const int32_t placeholder = 0;  // the token comes from ids on the device
    for (size_t i = 0; i < plan.size(); ++i) {
        Request& r = *plan[i].request;
        r.reserved = r.n_tokens() + 1;
        next.plan.push_back({&r, r.n_tokens(), 1, true, 0});
        next.rows.push_back(int64_t(i));
        chunks.push_back({int(r.id), r.n_tokens(), std::span(&placeholder, 1), false});
    }
    const Tensor logits = runner->forward_on_device(chunks, {}, ids);
    next.ids = runner->sample_rows_on_device(logits, sampling_rows(next.plan, std::vector<std::vector<int32_t>>(plan.size())));
    queued = std::move(next);
    ++overlapped_steps;
}

void Engine::Impl::drop_queued(uint64_t id) {
    if (!queued) return;
    for (size_t i = 0; i < queued->plan.size(); ++i) {
        if (queued->plan[i].request->id != id) continue;
        queued->plan.erase(queued->plan.begin() + long(i));
        queued->rows.erase(queued->rows.begin() + long(i));
        ++overlap_wasted_rows;
        break;
    }
    if (queued->plan.empty()) queued.reset();
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
    if (!sampling.stop.empty() && !impl_->detokenizer)
        fail("submit: stop strings need the model's tokenizer (tokenizer.json next to config.json), and none was "
             "loaded");
    for (const std::string& s : sampling.stop)
        if (s.empty()) fail("submit: empty stop string");
    const uint64_t id = impl_->next_id.fetch_add(1);
    XINFER_CHECK(id < (uint64_t(1) << 31), "request ids exhausted");
    auto request = std::make_unique<Request>(id, std::move(prompt), sampling, max_tokens);
    request->stop_ids = std::move(stop_ids);
    request->detokenizer = impl_->detokenizer;
    request->callback = std::move(callback);
    std::lock_guard<std::mutex> lock(impl_->inbox_mutex);
    impl_->inbox.push_back(std::move(request));
    return id;
}

bool Engine::abort(uint64_t id) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->drain_inbox();  // a request submitted a moment ago is abortable too
    impl_->drop_queued(id);
    std::unique_ptr<Request> request = impl_->scheduler->abort(id);  // frees its pages now
    if (!request) return false;
    if (impl_->drafter) impl_->drafter->release(int(id));
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
    // A step queued by the previous one (overlapped decode) is on the device already, its
    // finished requests taken out; else the scheduler plans this one.
    std::vector<ScheduledChunk> plan;
    std::vector<int64_t> first_rows;  // token row of each chunk in the forward
    std::vector<int64_t> out_rows;    // first logits (and picked-token) row of each chunk
    Tensor device_ids;                // [rows] picked tokens on the device (queued steps and on_device)
    if (e.queued) {
        plan = std::move(e.queued->plan);
        out_rows = std::move(e.queued->rows);
        device_ids = e.queued->ids;
        e.queued.reset();
    }
    const bool was_queued = !plan.empty();
    if (!was_queued) plan = e.scheduler->schedule();
    if (e.drafter)
        for (uint64_t id : e.scheduler->take_preempted()) e.drafter->release(int(id));
    if (plan.empty()) return outputs;
    ProfileRegion region(e.profiler.get(), e.steps, plan);

    // A decode with drafts verifies the chain [anchor, d1 … dk] and needs logits for every row.
    const std::vector<std::vector<int32_t>> drafts =
        was_queued ? std::vector<std::vector<int32_t>>(plan.size()) : e.propose(plan);
    std::vector<std::vector<int32_t>> chains(plan.size());
    std::vector<SequenceChunk> chunks;
    chunks.reserve(plan.size());
    int64_t rows = 0;
    for (size_t i = 0; i < plan.size() && !was_queued; ++i) {
        const ScheduledChunk& c = plan[i];
        std::span<const int32_t> tokens = std::span<const int32_t>(c.request->tokens).subspan(size_t(c.start), size_t(c.count));
        if (!drafts[i].empty()) {
            chains[i].assign(tokens.begin(), tokens.end());
            chains[i].insert(chains[i].end(), drafts[i].begin(), drafts[i].end());
            tokens = chains[i];
        }
        chunks.push_back({int(c.request->id), c.start, tokens, !drafts[i].empty()});
        first_rows.push_back(rows);
        rows += int64_t(tokens.size());
        out_rows.push_back(i == 0 ? 0 : out_rows.back() + int64_t(drafts[i - 1].size()) + 1);
    }
    // Tokens are picked on the device (one id per logits row downloaded instead of the row) unless
    // a chain must be verified by rejection sampling, which needs whole distributions on the host.
    // Rows that sample draw their uniform from the request's own stream, as Sampler::sample does.
    bool on_device = true;
    for (size_t i = 0; i < plan.size(); ++i)
        on_device = on_device && (!plan[i].samples || drafts[i].empty() || plan[i].request->sampler.greedy());
    TapFn census;  // set_expert_census: count the distinct experts of every MoE layer
    if (e.expert_census)
        census = [&e](std::string_view name, int, const Tensor& ids /*[T, top_k] i32*/) {
            if (name != "expert_ids") return;
            std::vector<int32_t> host(size_t(ids.numel()));
            e.runner->backend().download(ids, host.data());
            std::sort(host.begin(), host.end());
            host.erase(std::unique(host.begin(), host.end()), host.end());
            e.census_distinct_experts += std::count_if(host.begin(), host.end(), [](int32_t id) { return id >= 0; });
            ++e.census_moe_layer_steps;
        };
    std::vector<float> logits;
    std::vector<int32_t> device_tokens;  // [rows] when on_device
    if (!was_queued) {
        const Tensor device_logits = e.runner->forward_on_device(chunks, census);
        if (on_device) device_ids = e.runner->sample_rows_on_device(device_logits, e.sampling_rows(plan, drafts));
        else logits = e.runner->download_logits(device_logits);
    }
    if (on_device) {
        // The ids' download is queued before the next step, so it lands while that step runs.
        device_tokens.resize(size_t(device_ids.numel()));
        Backend& backend = e.runner->backend();
        backend.download_async(device_ids, device_tokens.data());
        e.queue_next(plan, device_ids);
        backend.wait_downloads();
    }
    ++e.steps;

    // Logits rows: a chain's k + 1 rows, else one per chunk; only chunks that reach the end of
    // their known tokens sample (or verify).
    const int64_t vocab = e.runner->model().config().vocab_size;
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::vector<int32_t>> emitted(plan.size());
    std::vector<int> accepted(plan.size(), -1);
    for (size_t i = 0; i < plan.size(); ++i) {
        const size_t n_rows = drafts[i].size() + 1, row = size_t(out_rows[i]);
        const std::span<const float> chunk_logits =
            on_device ? std::span<const float>{} : std::span(logits).subspan(row * size_t(vocab), n_rows * size_t(vocab));
        const std::span<const int32_t> chunk_tokens =
            on_device ? std::span(device_tokens).subspan(row, n_rows) : std::span<const int32_t>{};
        if (!plan[i].samples) continue;
        Request& r = *plan[i].request;
        emitted[i] = emit_tokens(r, chunk_logits, chunk_tokens, vocab, drafts[i], e.scheduler_options.max_model_len,
                                 accepted[i]);
        if (accepted[i] >= 0) e.spec.add(drafts[i], accepted[i]);
        // K/V are final for the anchor and the accepted drafts that stayed in the sequence.
        plan[i].count = std::min<int64_t>(plan[i].count + int64_t(emitted[i].size()) - 1, r.n_tokens() - plan[i].start);
        if (r.n_generated() == int64_t(emitted[i].size())) r.first_token = now;
        r.last_token = now;
    }
    if (e.drafter) e.observe(plan, first_rows);
    // complete() commits the computed tokens, rolls back rejected drafts' slots, and hands back
    // finished requests (kept alive here until their outputs are built).
    const std::vector<std::unique_ptr<Request>> finished = e.scheduler->complete(plan);
    if (e.drafter)
        for (const std::unique_ptr<Request>& r : finished) e.drafter->release(int(r->id));
    for (const std::unique_ptr<Request>& r : finished) e.drop_queued(r->id);
    for (size_t i = 0; i < plan.size(); ++i) {
        if (emitted[i].empty()) continue;
        Request& r = *plan[i].request;
        RequestOutput out = output_of(r, now);
        out.new_tokens = emitted[i];
        if (accepted[i] >= 0) {
            out.proposed = drafts[i];
            out.accepted = accepted[i];
        }
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
    if (impl_->drafter) s.spec_method = impl_->drafter->method();
    s.spec = impl_->spec;
    s.census_moe_layer_steps = impl_->census_moe_layer_steps;
    s.census_distinct_experts = impl_->census_distinct_experts;
    s.overlapped_steps = impl_->overlapped_steps;
    s.overlap_wasted_rows = impl_->overlap_wasted_rows;
    return s;
}

void Engine::set_overlap_decode(bool on) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->overlap = on;
}

void Engine::set_expert_census(bool on) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->expert_census = on;
}

const std::string& Engine::plan_report() const { return impl_->plan_report; }

DecodeWeightBytes Engine::decode_weight_bytes() const {
    const Model& model = impl_->runner->model();
    return {model.weight_bytes_per_decode_token(), model.expert_weight_bytes()};
}

bool Engine::has_tokenizer() const { return impl_->detokenizer != nullptr; }

std::vector<int32_t> Engine::encode(const std::string& text) const {
    if (!impl_->encoder) fail("this model has no tokenizer.json, so prompts must be token ids");
    return impl_->encoder->encode(text);
}

void Engine::start_profile() {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->profiler) fail("start_profile: a profile is already running");
    impl_->profiler = std::make_unique<Profiler>(impl_->runner->backend());
}

std::string Engine::stop_profile(const std::string& trace_path) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (!impl_->profiler) fail("stop_profile: no profile is running (call start_profile first)");
    std::unique_ptr<Profiler> profiler = std::move(impl_->profiler);
    profiler->stop();
    profiler->write_chrome_trace(trace_path);
    return profiler->summary();
}

}  // namespace xinfer
