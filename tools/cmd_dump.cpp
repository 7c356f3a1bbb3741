// xinfer dump: one prefill of a prompt with every named intermediate (DESIGN.md decision 3)
// downloaded and written to a .safetensors file — "<name>" for tensors outside the layers,
// "layers.<L>.<name>" inside — for `xinfer xray --a-dump/--b-dump` or any other tool.
#include "commands.h"
#include "runtime/xray.h"

#include <fmt/core.h>

namespace xinfer::cli {

void add_dump_command(CLI::App& app) {
    struct Options {
        ModelOptions model;
        std::string prompt_ids;
        std::string out;
        std::string names;
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand(
        "dump", "Run one prefill and write every named intermediate (as f32; expert ids as i32) to a .safetensors file");
    options->model.add_to(*cmd);
    cmd->add_option("--prompt-ids", options->prompt_ids, "Prompt token ids, comma-separated")->required();
    cmd->add_option("--out", options->out, "Output .safetensors path")->required();
    cmd->add_option("--names", options->names,
                    "Keep only tensors whose name matches this regex (searched in e.g. \"layers.3.attn_output\")");
    cmd->callback([options] {
        const std::vector<int32_t> prompt = parse_ids(options->prompt_ids);
        xray::CaptureOptions capture_options;
        if (!options->names.empty()) capture_options.names = std::regex(options->names);
        LoadedModel loaded = load(options->model);
        xray::ActivationSet set = xray::capture(*loaded.model, *loaded.backend, prompt, capture_options);
        if (set.tensors.empty()) fail("dump: no tensor name matches --names '{}'", options->names);
        set.metadata["model"] = options->model.model_dir;
        set.metadata["architecture"] = loaded.model->config().architecture;
        xray::write_dump(options->out, set);
        fmt::print("wrote {}: {} tensors from {} ({} activations), {} prompt tokens\n", options->out, set.tensors.size(),
                   loaded.backend->name(), dtype_name(set.compute_dtype), prompt.size());
    });
}

}  // namespace xinfer::cli
