// xinfer xray: runs (or reads) the named intermediates of one prompt on two sides and prints
// per-layer relative errors and NMSE for every tensor, naming the FIRST tensor in forward order
// that exceeds the threshold (exit status 1 then). Each side is a live device (--a cpu,
// --b cuda:0: load the model there, one prefill with taps) or dump files (--a-dump/--b-dump:
// from `xinfer dump`, from another framework using the same names, or transformers' hidden
// states, e.g. tests/fixtures/*/reference_hidden.safetensors). Metrics and the pass/fail rules,
// including the router rule for expert_ids, are in src/runtime/xray.h.
#include "commands.h"
#include "runtime/xray.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

namespace xinfer::cli {
namespace {

struct Side {
    std::string device;
    std::vector<std::string> dumps;
};

xray::ActivationSet load_side(const char* label, const Side& side, const ModelOptions& model,
                              const std::vector<int32_t>& prompt, const xray::CaptureOptions& capture_options,
                              const xray::NameMap& names) {
    if (!side.dumps.empty()) {
        std::vector<std::filesystem::path> paths(side.dumps.begin(), side.dumps.end());
        xray::ActivationSet set = xray::read_dump(paths, names);
        if (auto it = set.metadata.find("prompt_ids"); it != set.metadata.end() && !prompt.empty()) {
            std::vector<int32_t> dumped = parse_ids(it->second);
            if (dumped != prompt)
                fail("xray: side {} ({}) was dumped for prompt {}, not --prompt-ids {}", label, set.source, it->second,
                     fmt::format("{}", fmt::join(prompt, ",")));
        }
        return set;
    }
    if (model.model_dir.empty()) fail("xray: side {} runs on {} and needs --model", label, side.device);
    if (prompt.empty()) fail("xray: side {} runs on {} and needs --prompt-ids", label, side.device);
    ModelOptions options = model;
    options.device = side.device;
    LoadedModel loaded = load(options);
    fmt::print(stderr, "xray: side {}: {} on {} ({})\n", label, options.model_dir, loaded.backend->name(),
               loaded.backend->props().name);
    return xray::capture(*loaded.model, *loaded.backend, prompt, capture_options);
}

}  // namespace

void add_xray_command(CLI::App& app) {
    struct Options {
        ModelOptions model;
        std::string prompt_ids;
        Side a, b;
        double threshold = 0;  // 0: per-dtype thresholds
        double f32_threshold = 1e-4, reduced_threshold = 3e-2;
        std::string names;
        std::string name_map = "transformers";
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand(
        "xray", "Compare the named intermediates of two backends or dumps layer by layer; exit 1 if any tensor is over "
                "threshold, naming the first one in forward order");
    cmd->add_option("--model", options->model.model_dir, "Model directory (needed for live sides)");
    cmd->add_option("--load-format", options->model.load_format, "safetensors, or dummy (random weights)")
        ->check(CLI::IsMember({"safetensors", "dummy"}))
        ->default_val("safetensors");
    cmd->add_option("--dtype", options->model.dtype,
                    "Activation dtype of live accelerator sides: auto (the checkpoint's), float32, bfloat16")
        ->check(CLI::IsMember({"auto", "float32", "bfloat16"}))
        ->default_val("auto");
    cmd->add_option("--fp8-weights", options->model.fp8_weights,
                    "FP8 matrices of live accelerator sides: auto (keep e4m3 + scales where supported) or dequantize")
        ->check(CLI::IsMember({"auto", "keep", "dequantize"}))
        ->default_val("auto");
    cmd->add_option("--prompt-ids", options->prompt_ids, "Prompt token ids, comma-separated (needed for live sides)");
    auto* a = cmd->add_option("--a", options->a.device, "Side a: device to run on (cpu, cuda, cuda:N, <plugin>)");
    auto* a_dump = cmd->add_option("--a-dump", options->a.dumps, "Side a: dump file(s) (.safetensors; repeat to merge)");
    auto* b = cmd->add_option("--b", options->b.device, "Side b: device to run on; max|b| normalises the error");
    auto* b_dump = cmd->add_option("--b-dump", options->b.dumps, "Side b: dump file(s) (.safetensors; repeat to merge)");
    a->excludes(a_dump);
    b->excludes(b_dump);
    cmd->add_option("--threshold", options->threshold,
                    "Relative-error threshold for every tensor (overrides the two below; 0 = per-dtype)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--f32-threshold", options->f32_threshold, "Threshold when both sides computed in f32")
        ->default_val(1e-4);
    cmd->add_option("--bf16-threshold", options->reduced_threshold,
                    "Threshold when either side computed in bf16/f16 (device backends)")
        ->default_val(3e-2);
    cmd->add_option("--names", options->names, "Compare only tensors whose name matches this regex");
    cmd->add_option("--name-map", options->name_map,
                    "Renaming of dump tensors: transformers (embed, layer.L, final_norm → xinfer names) or none")
        ->check(CLI::IsMember({"transformers", "none"}))
        ->default_val("transformers");
    cmd->callback([options] {
        for (auto [label, side] : {std::pair{"a", &options->a}, std::pair{"b", &options->b}})
            if (side->device.empty() && side->dumps.empty()) fail("xray: give --{} DEVICE or --{}-dump FILE", label, label);
        const std::vector<int32_t> prompt =
            options->prompt_ids.empty() ? std::vector<int32_t>{} : parse_ids(options->prompt_ids);
        xray::CaptureOptions capture_options;
        xray::CompareOptions compare_options;
        if (!options->names.empty()) {
            capture_options.names = std::regex(options->names);
            compare_options.names = std::regex(options->names);
        }
        compare_options.thresholds.f32 = options->f32_threshold;
        compare_options.thresholds.reduced = options->reduced_threshold;
        if (options->threshold > 0) compare_options.thresholds.override_all = options->threshold;
        const xray::NameMap names =
            options->name_map == "none" ? xray::NameMap::identity() : xray::NameMap::transformers_hidden();

        const xray::ActivationSet set_a = load_side("a", options->a, options->model, prompt, capture_options, names);
        const xray::ActivationSet set_b = load_side("b", options->b, options->model, prompt, capture_options, names);
        auto pa = set_a.metadata.find("prompt_ids"), pb = set_b.metadata.find("prompt_ids");
        if (pa != set_a.metadata.end() && pb != set_b.metadata.end() && pa->second != pb->second)
            fail("xray: a ({}) and b ({}) ran different prompts: {} vs {}", set_a.source, set_b.source, pa->second,
                 pb->second);
        const xray::Report report = xray::compare(set_a, set_b, compare_options);
        fmt::print("{}", xray::format_report(report));
        if (!report.ok()) throw CLI::RuntimeError(1);
    });
}

}  // namespace xinfer::cli
