// Engine::create: options → memory plan (refuse early) → model → KV pool → engine.
#include "core/status.h"
#include "runtime/engine_impl.h"
#include "models/fp8_weights.h"
#include "runtime/memory_plan.h"
#include "tokenizer/tokenizer_json.h"

#include <fmt/core.h>

#include <filesystem>

namespace xinfer {
namespace {

// Host-memory backends report all of RAM; their KV pool defaults to this (as vLLM's CPU
// backend's VLLM_CPU_KVCACHE_SPACE) rather than 90% of the machine.
constexpr int64_t kHostKvDefaultBytes = int64_t(4) << 30;

// The dtypes the decoder will choose (src/models/decoder.cpp), known before loading.
DType planned_activation_dtype(const ModelConfig& config, const EngineOptions& options, bool host_memory) {
    if (host_memory) return DType::f32;
    if (options.dtype == "float32") return DType::f32;
    if (options.dtype == "bfloat16") return DType::bf16;
    return config.dtype == DType::f32 ? DType::f32 : DType::bf16;
}

DType planned_weight_dtype(const ModelConfig& config, const EngineOptions& options, bool host_memory, bool fp8,
                           DType activation) {
    if (!host_memory) return activation;
    if (options.load_format == "dummy") return DType::bf16;
    return fp8 ? DType::f32 : config.dtype;
}

}  // namespace

std::unique_ptr<Engine> Engine::create(const EngineOptions& options) {
    auto backend = make_backend(options.device);
    const bool dummy = options.load_format == "dummy";
    if (!dummy && options.load_format != "safetensors")
        fail("load format \"{}\": expected safetensors or dummy", options.load_format);
    auto checkpoint = Checkpoint::open(options.model_dir, /*load_weights=*/!dummy);
    // The tokenizer is read before the weights, so a broken one fails in seconds, not after a load.
    std::unique_ptr<Detokenizer> detokenizer;
    std::unique_ptr<BpeEncoder> encoder;
    const std::filesystem::path tokenizer = std::filesystem::path(options.model_dir) / "tokenizer.json";
    if (std::filesystem::exists(tokenizer)) {
        const nlohmann::json doc = read_tokenizer_json(tokenizer);  // parsed once for both
        detokenizer = std::make_unique<Detokenizer>(Detokenizer::from_json(doc, tokenizer.string()));
        encoder = std::make_unique<BpeEncoder>(BpeEncoder::from_json(doc, tokenizer.string()));
    }
    const ModelConfig config = read_model_config(*checkpoint);
    const bool host = backend->props().host_memory != 0;

    PlanOptions plan_options;
    plan_options.device_memory = options.device_memory ? options.device_memory : backend->props().total_memory;
    plan_options.gpu_memory_utilization = options.gpu_memory_utilization;
    plan_options.max_model_len = options.max_model_len;
    plan_options.max_num_seqs = options.max_num_seqs;
    plan_options.max_num_batched_tokens = options.max_num_batched_tokens;
    plan_options.activation_dtype = planned_activation_dtype(config, options, host);
    plan_options.weight_dtype = planned_weight_dtype(config, options, host, checkpoint->fp8().enabled,
                                                     plan_options.activation_dtype);
    LoadOptions load_options;
    load_options.dummy = dummy;
    load_options.dtype = options.dtype;
    load_options.fp8_weights = options.fp8_weights;
    plan_options.fp8_weights = keep_fp8_weights(config, load_options, *backend, plan_options.activation_dtype);
    plan_options.kv_dtype = resolve_kv_cache_dtype(options.kv_cache_dtype, plan_options.activation_dtype);
    plan_options.speculative_config = options.speculative_config;
    plan_options.min_tokens_per_page = options.min_tokens_per_page;
    plan_options.kv_cache_memory = options.kv_cache_memory;
    if (options.kv_cache_tokens > 0) {
        const KvLayout layout =
            make_kv_layout(kv_group_shapes(config), plan_options.kv_dtype, options.min_tokens_per_page);
        int64_t pages = 0;
        for (size_t g = 0; g < layout.groups.size(); ++g) pages += layout.pages_for(int(g), options.kv_cache_tokens);
        plan_options.kv_cache_memory = pages * layout.page_bytes;
    }
    MemoryPlan plan = plan_memory(config, plan_options);
    if (host && plan_options.kv_cache_memory == 0 && plan.kv_bytes > kHostKvDefaultBytes) {
        plan_options.kv_cache_memory = kHostKvDefaultBytes;
        plan = plan_memory(config, plan_options);
    }
    if (!plan.fits)
        fail("the configuration does not fit {} (nothing was loaded):\n{}", backend->name(), plan.report());
    // The budget is a fraction of the device's total memory; another process (or another engine)
    // holding part of it would otherwise surface as an out-of-memory error halfway through the
    // load. Host backends are left out: their free figure counts neither page cache nor swap.
    if (!host && options.device_memory == 0 && backend->props().free_memory > 0) {
        const std::string shortfall = free_memory_shortfall(plan, backend->props().free_memory);
        if (!shortfall.empty())
            fail("the configuration does not fit what is free on {} (nothing was loaded): {}", backend->name(),
                 shortfall);
    }

    auto model = load_model(*checkpoint, *backend, load_options);

    // The drafter (if any) borrows the loaded target; the runner exports the features it reads.
    const SpeculativeConfig spec_config = parse_speculative_config(options.speculative_config);
    std::unique_ptr<Drafter> drafter;
    if (spec_config.enabled())
        drafter = make_drafter(spec_config, DrafterContext{*model, *backend, options.model_dir, dummy,
                                                           options.max_num_seqs, plan.max_model_len,
                                                           options.max_num_batched_tokens});

    RunnerOptions runner_options;
    if (drafter) runner_options.feature_layers = drafter->feature_layers();
    runner_options.page_size = options.min_tokens_per_page;
    runner_options.n_pages = plan.n_pages;
    runner_options.kv_cache_dtype = options.kv_cache_dtype;
    runner_options.enable_prefix_caching = options.enable_prefix_caching;
    runner_options.enforce_eager = options.enforce_eager;
    runner_options.max_graph_batch = options.max_num_seqs;
    runner_options.max_seq_len = std::min<int64_t>(plan.max_model_len, kMaxGraphSeqLen);
    auto runner = std::make_unique<Runner>(*model, *backend, runner_options);
    runner->capture_graphs();  // at startup, as vLLM: the first decode steps then replay

    SchedulerOptions scheduler_options;
    scheduler_options.max_num_seqs = options.max_num_seqs;
    scheduler_options.max_num_batched_tokens = options.max_num_batched_tokens;
    scheduler_options.max_model_len = plan.max_model_len;
    auto impl = std::make_unique<Impl>(*runner, scheduler_options, drafter.get());
    impl->backend = std::move(backend);
    impl->checkpoint = std::move(checkpoint);
    impl->model = std::move(model);
    impl->owned_runner = std::move(runner);
    impl->owned_drafter = std::move(drafter);
    impl->plan_report = plan.report();
    impl->overlap = options.overlap_decode;
    impl->owned_detokenizer = std::move(detokenizer);
    impl->detokenizer = impl->owned_detokenizer.get();
    impl->encoder = std::move(encoder);
    return std::make_unique<Engine>(std::move(impl));
}

}  // namespace xinfer
