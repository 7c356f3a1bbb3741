// Shared by the DFlash tests: the tiny MiMo target (tests/fixtures/mimo_native_f32), drafter
// checkpoints copied/modified into temp dirs, and a driver that replays the z-lab reference loop
// (dflash_generate) with xinfer's Runner as the target.
#pragma once

#include "backend/backend.h"
#include "loader/safetensors_file.h"
#include "loader/safetensors_writer.h"
#include "runtime/runner.h"
#include "spec/dflash.h"
#include "unit/safetensors_test_writer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <vector>

namespace xinfer::test {

inline std::filesystem::path dflash_fixture(const std::string& name) {
    const char* env = std::getenv("XINFER_FIXTURES_DIR");
    return std::filesystem::path(env && *env ? env : XINFER_FIXTURES_DIR) / name;
}

inline nlohmann::json read_json(const std::filesystem::path& path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path.string());
    return nlohmann::json::parse(in);
}

inline void write_json(const std::filesystem::path& path, const nlohmann::json& json) {
    std::ofstream(path) << json.dump(2);
}

struct TargetModel {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Checkpoint> checkpoint;
    std::unique_ptr<Model> model;
};

// The target on `device` ("cpu": the oracle the numerics tests compare on), with the activation
// dtype XINFER_TEST_DTYPE on devices (auto when unset).
inline TargetModel load_target(const std::string& device = "cpu") {
    TargetModel t;
    t.backend = make_backend(device);
    t.checkpoint = Checkpoint::open(dflash_fixture("mimo_native_f32"));
    LoadOptions options;
    if (const char* dtype = std::getenv("XINFER_TEST_DTYPE"); dtype && device != "cpu") options.dtype = dtype;
    t.model = load_model(*t.checkpoint, *t.backend, options);
    return t;
}

inline std::unique_ptr<DFlashDrafter> make_dflash(TargetModel& t, const std::filesystem::path& dir, int k = 0,
                                                  bool dummy = false, int max_seqs = 2, int64_t max_len = 256) {
    SpeculativeConfig spec;
    spec.method = "dflash";
    spec.model = dir.string();
    spec.num_speculative_tokens = k;
    auto drafter = std::make_unique<DFlashDrafter>(spec, DrafterContext{*t.model, *t.backend, "", dummy, max_seqs, max_len});
    drafter->keep_logits(true);  // the tests compare logits; the engine path (device argmax) is tested through make_drafter
    return drafter;
}

// A safetensors file's tensors as f32 host vectors (with shapes), to rewrite modified copies.
struct HostTensors {
    std::map<std::string, std::vector<int64_t>> shapes;
    std::map<std::string, std::vector<float>> values;
};

inline HostTensors read_tensors(const std::filesystem::path& path) {
    HostTensors h;
    auto file = SafetensorsFile::open(path);
    for (const TensorInfo& t : file->tensors()) {
        std::vector<float> v(size_t(t.numel()));
        convert_to_f32(t.dtype, t.data, v.data(), t.numel());
        h.shapes[t.name] = t.shape;
        h.values[t.name] = std::move(v);
    }
    return h;
}

inline void write_tensors(const std::filesystem::path& path, const HostTensors& h) {
    std::vector<SafetensorsEntry> entries;
    for (const auto& [name, values] : h.values) entries.push_back({name, DType::f32, h.shapes.at(name), values.data()});
    write_safetensors(path, entries);
}

// Copies a fixture drafter directory (config, weights, sidecar) into `dir`.
inline void copy_drafter(const std::string& fixture, const std::filesystem::path& dir) {
    for (const char* name : {"config.json", "model.safetensors", "mask_embedding.safetensors"}) {
        const std::filesystem::path from = dflash_fixture(fixture) / name;
        if (std::filesystem::exists(from))
            std::filesystem::copy_file(from, dir / name, std::filesystem::copy_options::overwrite_existing);
    }
}

inline int32_t argmax(const float* row, int64_t n) { return int32_t(std::max_element(row, row + n) - row); }

// One step of the reference loop, as recorded.
struct RefStep {
    int64_t start = 0;
    std::vector<int32_t> proposed;
    std::vector<double> margins;
    int accepted = 0;
};

struct DFlashReference {
    std::vector<int32_t> prompt, output, greedy;
    int block_size = 0;
    int max_new_tokens = 0;
    std::vector<RefStep> steps;
    std::vector<std::vector<float>> draft_logits;  // per step, [B-1, vocab] each
};

inline DFlashReference load_reference(const std::string& fixture) {
    const nlohmann::json j = read_json(dflash_fixture(fixture) / "reference.json");
    DFlashReference r;
    r.prompt = j.at("prompt_ids").get<std::vector<int32_t>>();
    r.output = j.at("output_ids").get<std::vector<int32_t>>();
    r.greedy = j.at("greedy_ids").get<std::vector<int32_t>>();
    r.block_size = j.at("block_size").get<int>();
    r.max_new_tokens = j.at("max_new_tokens").get<int>();
    for (const nlohmann::json& s : j.at("steps"))
        r.steps.push_back({s.at("start").get<int64_t>(), s.at("proposed").get<std::vector<int32_t>>(),
                           s.at("margins").get<std::vector<double>>(), s.at("accepted").get<int>()});
    HostTensors logits = read_tensors(dflash_fixture(fixture) / "reference.safetensors");
    for (int i = 0;; ++i) {
        auto it = logits.values.find("draft_logits." + std::to_string(i));
        if (it == logits.values.end()) break;
        r.draft_logits.push_back(it->second);
    }
    return r;
}

// What one replay of the reference loop produced.
struct Replay {
    std::vector<std::vector<int32_t>> proposed;
    std::vector<int> accepted;
    std::vector<int32_t> output;                    // generated tokens (max_new_tokens)
    std::vector<std::vector<float>> draft_logits;  // every step, [B-1, vocab]
};

// z-lab's dflash_generate with xinfer's Runner as the target and `drafter` proposing: prefill,
// then while start < prompt + max_new: propose B-1, verify [anchor, drafts] causally, accept the
// longest matching prefix plus the bonus, roll the target's KV back to the committed length and
// show the drafter the committed rows' features.
inline Replay replay_reference_loop(TargetModel& t, DFlashDrafter& drafter, const std::vector<int32_t>& prompt,
                                    int max_new_tokens, int seq = 7) {
    const int block = drafter.config().block_size;
    RunnerOptions options;
    options.max_cached_tokens = 512;
    options.feature_layers = drafter.feature_layers();
    Runner runner(*t.model, *t.backend, options);
    const int64_t vocab = t.model->config().vocab_size;
    KvCacheManager& kv = runner.kv();
    kv.add_sequence(seq, {});

    std::vector<int32_t> tokens = prompt;
    auto forward = [&](int64_t start, std::span<const int32_t> chunk, bool all_logits) {
        EXPECT_TRUE(kv.allocate(seq, start + int64_t(chunk.size())));
        SequenceChunk c{seq, start, chunk, all_logits};
        return runner.forward(std::span(&c, 1));
    };
    auto observe = [&](int64_t start, int64_t n) {
        TargetHidden hidden;
        hidden.features = runner.features();
        hidden.sequences.push_back({seq, 0, start, n, tokens});
        drafter.observe(hidden);
    };

    Replay replay;
    std::vector<float> logits = forward(0, prompt, false);
    tokens.push_back(argmax(logits.data(), vocab));
    kv.commit(seq, tokens, int64_t(prompt.size()));
    observe(0, int64_t(prompt.size()));
    int64_t start = int64_t(prompt.size());
    const int64_t max_length = int64_t(prompt.size()) + max_new_tokens;
    while (start < max_length) {
        DraftRequest request{seq, tokens, block - 1};
        std::vector<int32_t> drafts = drafter.propose(std::span(&request, 1)).at(0);
        replay.proposed.push_back(drafts);
        replay.draft_logits.push_back(drafter.last_logits());
        if (int(drafts.size()) != block - 1) {
            ADD_FAILURE() << "step " << replay.proposed.size() << ": " << drafts.size() << " drafts";
            break;
        }
        std::vector<int32_t> chain{tokens.back()};
        chain.insert(chain.end(), drafts.begin(), drafts.end());
        logits = forward(start, chain, true);
        int accepted = 0;
        while (accepted < block - 1 && drafts[size_t(accepted)] == argmax(logits.data() + accepted * vocab, vocab))
            ++accepted;
        replay.accepted.push_back(accepted);
        tokens.insert(tokens.end(), drafts.begin(), drafts.begin() + accepted);
        tokens.push_back(argmax(logits.data() + accepted * vocab, vocab));
        kv.commit(seq, tokens, start + accepted + 1);
        kv.truncate(seq, start + accepted + 1);
        observe(start, accepted + 1);
        start += accepted + 1;
    }
    replay.output.assign(tokens.begin() + long(prompt.size()),
                         tokens.begin() + long(std::min<size_t>(tokens.size(), size_t(max_length))));
    runner.release(seq);
    drafter.release(seq);
    return replay;
}

}  // namespace xinfer::test
