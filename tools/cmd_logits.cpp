// xinfer logits: float32 logits for every prompt position, written as a NumPy .npy [T, vocab].
#include "commands.h"
#include "loader/npy.h"
#include "runtime/generate.h"

#include <fmt/core.h>

namespace xinfer::cli {

void add_logits_command(CLI::App& app) {
    struct Options {
        ModelOptions model;
        std::string prompt_ids;
        std::string out;
        int64_t prefill_chunk = 0;
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand("logits", "Write logits for every prompt position to a .npy file");
    options->model.add_to(*cmd);
    cmd->add_option("--prompt-ids", options->prompt_ids, "Prompt token ids, comma-separated")->required();
    cmd->add_option("--out", options->out, "Output .npy path (float32, [T, vocab])")->required();
    cmd->add_option("--prefill-chunk", options->prefill_chunk, "Max prompt tokens per step (0 = all)")->default_val(0);
    cmd->callback([options] {
        const std::vector<int32_t> prompt = parse_ids(options->prompt_ids);
        LoadedModel loaded = load(options->model);
        RunnerOptions runner_options;
        runner_options.max_cached_tokens =
            options->model.max_cached_tokens > 0 ? options->model.max_cached_tokens : int64_t(prompt.size()) + 16;
        Runner runner(*loaded.model, *loaded.backend, runner_options);
        std::vector<float> logits = prompt_logits(runner, prompt, options->prefill_chunk);
        const int64_t vocab = loaded.model->config().vocab_size;
        write_npy_f32(options->out, logits.data(), {int64_t(prompt.size()), vocab});
        fmt::print("wrote {} [{}, {}] float32\n", options->out, prompt.size(), vocab);
    });
}

}  // namespace xinfer::cli
