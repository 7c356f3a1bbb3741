// xray and dump: the comparison engine on synthetic activations (metrics, thresholds, NaN,
// the router rule), CPU against CPU (exactly zero), fault injection (a backend that perturbs one
// op at one layer must be named first), the CPU against transformers' per-layer hidden states,
// and the dump file's names — through the library and through the xinfer binary.
#include "backend/op_desc.h"
#include "faulty_backend.h"
#include "fixture.h"
#include "runtime/xray.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <array>
#include <cstdio>
#include <iostream>
#include <set>

namespace xinfer::test {
namespace {

using xray::Activation;
using xray::ActivationSet;
using xray::Report;
using xray::TensorDiff;

// ---- helpers ----------------------------------------------------------------------------------

struct CommandResult {
    int status;
    std::string output;  // stdout and stderr
};

CommandResult run_xinfer(const std::string& args, const std::string& env = "") {
    const std::string command = fmt::format("{} {} {} 2>&1", env, XINFER_BINARY, args);
    FILE* pipe = popen(command.c_str(), "r");
    if (!pipe) throw std::runtime_error("popen failed: " + command);
    std::string output;
    std::array<char, 4096> buffer;
    while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
    const int status = pclose(pipe);
    return {WEXITSTATUS(status), output};
}

std::string join_ids(const std::vector<int32_t>& ids) { return fmt::format("{}", fmt::join(ids, ",")); }

struct Loaded {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Checkpoint> checkpoint;
    std::unique_ptr<Model> model;
    Loaded(std::unique_ptr<Backend> b, const std::filesystem::path& dir) : backend(std::move(b)) {
        checkpoint = Checkpoint::open(dir);
        model = load_model(*checkpoint, *backend);
    }
};

ActivationSet capture_on(std::unique_ptr<Backend> backend, const Fixture& f) {
    Loaded loaded(std::move(backend), f.dir);
    return xray::capture(*loaded.model, *loaded.backend, f.prompt);
}

Activation float_tensor(std::vector<float> values, DType dtype = DType::f32) {
    Activation a;
    a.dtype = dtype;
    a.shape = {int64_t(values.size())};
    a.values = std::move(values);
    return a;
}

Activation int_tensor(std::vector<float> values) { return float_tensor(std::move(values), DType::i32); }

const TensorDiff& find_diff(const Report& report, const std::string& name) {
    for (const TensorDiff& d : report.diffs)
        if (d.full_name == name) return d;
    throw std::runtime_error("no diff for " + name);
}

// ---- names and order ----------------------------------------------------------------------

TEST(XrayNames, RoundTripAndForwardOrder) {
    EXPECT_EQ(xray::tensor_name("embedding", -1), "embedding");
    EXPECT_EQ(xray::tensor_name("attn_output", 12), "layers.12.attn_output");
    EXPECT_EQ(xray::split_tensor_name("layers.12.attn_output"), (std::pair<std::string, int>{"attn_output", 12}));
    EXPECT_EQ(xray::split_tensor_name("logits"), (std::pair<std::string, int>{"logits", -1}));

    std::vector<std::string> names = {"logits", "layers.10.q", "layers.2.residual", "final_norm", "layers.2.q",
                                      "embedding", "layers.2.attn_input", "layers.2.expert_ids", "layers.2.zzz_custom"};
    std::sort(names.begin(), names.end(),
              [](const auto& x, const auto& y) { return xray::forward_order_key(x) < xray::forward_order_key(y); });
    EXPECT_EQ(names, (std::vector<std::string>{"embedding", "layers.2.attn_input", "layers.2.q", "layers.2.expert_ids",
                                               "layers.2.residual", "layers.2.zzz_custom", "layers.10.q", "final_norm",
                                               "logits"}));
}

TEST(XrayNames, TransformersHiddenStatesMap) {
    const xray::NameMap map = xray::NameMap::transformers_hidden();
    EXPECT_EQ(map.apply("embed"), "embedding");
    EXPECT_EQ(map.apply("layer.7"), "layers.7.residual");
    EXPECT_EQ(map.apply("final_norm"), "final_norm");
    EXPECT_EQ(map.apply("logits"), "logits");
    EXPECT_EQ(map.apply("layers.7.q"), "layers.7.q");
}

// ---- the comparison engine on synthetic sets ---------------------------------------------------

TEST(XrayCompare, MetricsThresholdAndFirstFailure) {
    ActivationSet a, b;
    a.tensors["embedding"] = float_tensor({1, 2, 3, 4});
    b.tensors["embedding"] = float_tensor({1, 2, 3, 4});
    a.tensors["layers.0.q"] = float_tensor({1, -2, 3, 4});
    b.tensors["layers.0.q"] = float_tensor({1, -2, 3, 4.0002f});  // rel 5e-5: passes 1e-4
    a.tensors["layers.1.k"] = float_tensor({1, 0, 0, 2});
    b.tensors["layers.1.k"] = float_tensor({1, 0, 0, 2.002f});  // rel ~1e-3: fails
    a.tensors["layers.0.v"] = float_tensor({0, 0});
    b.tensors["layers.0.v"] = float_tensor({0, 0.5f});  // rel 1: fails, and comes first
    a.tensors["only_a"] = float_tensor({1});
    b.tensors["only_b"] = float_tensor({1});

    const Report report = xray::compare(a, b);
    EXPECT_DOUBLE_EQ(report.threshold, 1e-4);
    EXPECT_EQ(find_diff(report, "embedding").rel, 0);
    const TensorDiff& q = find_diff(report, "layers.0.q");
    EXPECT_NEAR(q.rel, 0.0002 / 4.0002, 1e-7);
    EXPECT_NEAR(q.nmse, 0.0002 * 0.0002 / (1 + 4 + 9 + 4.0002 * 4.0002), 1e-9);
    EXPECT_FALSE(q.over);
    EXPECT_TRUE(find_diff(report, "layers.1.k").over);
    ASSERT_NE(report.first_failure(), nullptr);
    EXPECT_EQ(report.first_failure()->full_name, "layers.0.v");
    EXPECT_EQ(report.only_a, std::vector<std::string>{"only_a"});
    EXPECT_EQ(report.only_b, std::vector<std::string>{"only_b"});
    // The table names the first failure and marks failing cells.
    const std::string text = xray::format_report(report);
    EXPECT_NE(text.find("FIRST over threshold (forward order): layer 0 v"), std::string::npos) << text;
    EXPECT_NE(text.find("1.0e+00!"), std::string::npos) << text;

    // --threshold overrides; a bf16 side gets the reduced-precision threshold.
    xray::CompareOptions loose;
    loose.thresholds.override_all = 2.0;
    EXPECT_TRUE(xray::compare(a, b, loose).ok());
    b.compute_dtype = DType::bf16;
    EXPECT_DOUBLE_EQ(xray::compare(a, b).threshold, 3e-2);
    EXPECT_EQ(xray::compare(a, b).first_failure()->full_name, "layers.0.v");  // rel 1 still fails
}

TEST(XrayCompare, NanNeverPassesAndShapesMustAgree) {
    ActivationSet a, b;
    a.tensors["layers.0.q"] = float_tensor({1, NAN});
    b.tensors["layers.0.q"] = float_tensor({1, NAN});
    a.tensors["layers.0.k"] = float_tensor({1, 2, 3, 4});
    b.tensors["layers.0.k"] = float_tensor({1, 2, 3});
    Activation batched = float_tensor({1, 2, 3, 4});  // [1, 2, 2] vs [2, 2]: a batch dimension is fine
    batched.shape = {1, 2, 2};
    Activation plain = float_tensor({1, 2, 3, 4});
    plain.shape = {2, 2};
    a.tensors["layers.0.v"] = batched;
    b.tensors["layers.0.v"] = plain;
    xray::CompareOptions options;
    options.thresholds.override_all = 1e9;
    const Report report = xray::compare(a, b, options);
    EXPECT_TRUE(find_diff(report, "layers.0.q").fails());
    EXPECT_EQ(find_diff(report, "layers.0.q").nan_count, 1);  // elements NaN on either side
    EXPECT_TRUE(find_diff(report, "layers.0.k").shape_mismatch);
    EXPECT_FALSE(find_diff(report, "layers.0.v").over);
    EXPECT_EQ(report.first_failure()->name, "q");  // forward order: q before k
}

// The router rule: expert_ids that differ are excused (with their expert_weights) when the
// layer's ffn_output is within threshold, and fail — named first — when it is not.
TEST(XrayCompare, RouterRule) {
    auto make = [](float ffn_b) {
        std::pair<ActivationSet, ActivationSet> sides;
        auto& [a, b] = sides;
        a.tensors["layers.1.router_logits"] = float_tensor({0.5f, 0.5f, -1});
        b.tensors["layers.1.router_logits"] = float_tensor({0.5f, 0.5f, -1});
        a.tensors["layers.1.expert_ids"] = int_tensor({0, 1});
        b.tensors["layers.1.expert_ids"] = int_tensor({1, 0});  // near-tie flipped the order
        a.tensors["layers.1.expert_weights"] = float_tensor({0.6f, 0.4f});
        b.tensors["layers.1.expert_weights"] = float_tensor({0.4f, 0.6f});
        a.tensors["layers.1.ffn_output"] = float_tensor({1, 2});
        b.tensors["layers.1.ffn_output"] = float_tensor({1, ffn_b});
        return sides;
    };
    {
        auto [a, b] = make(2.f);
        const Report report = xray::compare(a, b);
        const TensorDiff& ids = find_diff(report, "layers.1.expert_ids");
        EXPECT_TRUE(ids.integer);
        EXPECT_EQ(ids.mismatches, 2);
        EXPECT_TRUE(ids.over && ids.excused);
        EXPECT_TRUE(find_diff(report, "layers.1.expert_weights").excused);
        EXPECT_TRUE(report.ok()) << xray::format_report(report);
        const std::string text = xray::format_report(report);
        EXPECT_NE(text.find("2/2~"), std::string::npos) << text;
        EXPECT_NE(text.find("excused: layer 1 expert_ids"), std::string::npos) << text;
    }
    {
        auto [a, b] = make(2.5f);
        const Report report = xray::compare(a, b);
        ASSERT_FALSE(report.ok());
        EXPECT_EQ(report.first_failure()->full_name, "layers.1.expert_ids");
    }
    {
        auto [a, b] = make(2.f);
        a.tensors.erase("layers.1.ffn_output");  // nothing downstream to vouch for the flip
        EXPECT_EQ(xray::compare(a, b).first_failure()->full_name, "layers.1.expert_ids");
    }
}

// ---- live captures ----------------------------------------------------------------------------

// Two CPU backends compute bit-identical activations: every error is exactly zero.
TEST(Xray, CpuVsCpuIsExactlyZero) {
    const Fixture f = load_fixture("mimo_hub_f32");
    const ActivationSet a = capture_on(make_cpu_backend(), f);
    const ActivationSet b = capture_on(make_cpu_backend(), f);
    const Report report = xray::compare(a, b);
    std::cout << xray::format_report(report);
    EXPECT_TRUE(report.ok());
    EXPECT_TRUE(report.only_a.empty() && report.only_b.empty());
    // 3 global + per layer 9 (dense) or 12 (MoE): mimo has 2 dense and 4 MoE layers.
    EXPECT_EQ(report.diffs.size(), 3u + 2 * 9 + 4 * 12);
    for (const TensorDiff& d : report.diffs) {
        EXPECT_EQ(d.rel, 0) << d.full_name;
        EXPECT_EQ(d.nmse, 0) << d.full_name;
        EXPECT_EQ(d.mismatches, 0) << d.full_name;
    }
}

// Fault injection: a backend identical to the CPU except for one op at one layer. xray must name
// that layer and the tapped tensor the op writes, and everything before it must be exactly equal.
struct FaultCase {
    int op_type;
    int layer;
    std::string expected;  // full tensor name of the first failure
};

void PrintTo(const FaultCase& c, std::ostream* os) {
    *os << op_type_name(c.op_type) << " at layer " << c.layer << " -> " << c.expected;
}

class XrayFault : public ::testing::TestWithParam<FaultCase> {};

TEST_P(XrayFault, NamesTheFaultyLayerAndTensorFirst) {
    const FaultCase& c = GetParam();
    const Fixture f = load_fixture("mimo_hub_f32");
    const ActivationSet reference = capture_on(make_cpu_backend(), f);
    const int hits_before = faulty_backend_hits();
    const ActivationSet faulty = capture_on(make_faulty_backend({c.op_type, c.layer, 1e-2}), f);
    EXPECT_GT(faulty_backend_hits(), hits_before) << "the fault never fired: are ops tagged with their layer?";
    const Report report = xray::compare(reference, faulty);
    std::cout << xray::format_report(report);
    const TensorDiff* first = report.first_failure();
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(first->full_name, c.expected);
    EXPECT_GT(first->rel, 1e-3);  // ~1e-2 of the output's scale
    for (const TensorDiff& d : report.diffs) {
        if (&d == first) break;
        EXPECT_EQ(d.rel, 0) << d.full_name << " precedes the fault";
    }
}

INSTANTIATE_TEST_SUITE_P(Ops, XrayFault,
                         ::testing::Values(FaultCase{XINFER_OP_ATTENTION, 2, "layers.2.attn_output"},
                                           FaultCase{XINFER_OP_MATMUL, 1, "layers.1.q"},
                                           FaultCase{XINFER_OP_MOE_EXPERTS, 3, "layers.3.ffn_output"},
                                           FaultCase{XINFER_OP_ADD_RMSNORM, 4, "layers.4.attn_input"}),
                         [](const auto& info) {
                             return fmt::format("{}_layer{}", op_type_name(info.param.op_type), info.param.layer);
                         });

// The CPU oracle against transformers' float64 hidden states (embedding, every layer's output,
// final norm) and logits, for every f32 fixture: clean at the f32 threshold.
TEST(Xray, CpuMatchesTransformersHiddenStates) {
    for (const std::string name : {"mimo_native_f32", "mimo_hub_f32", "qwen3_f32", "qwen3_moe_f32"}) {
        const Fixture f = load_fixture(name);
        const ActivationSet ours = capture_on(make_cpu_backend(), f);
        const ActivationSet reference =
            xray::read_dump({f.dir / "reference_hidden.safetensors", f.dir / "reference.safetensors"});
        const Report report = xray::compare(ours, reference);
        std::cout << name << ":\n" << xray::format_report(report);
        EXPECT_TRUE(report.ok()) << name;
        // embedding, every layer's residual, final_norm, logits.
        const size_t n_layers = size_t(std::count_if(ours.tensors.begin(), ours.tensors.end(), [](const auto& t) {
            return t.first.ends_with(".residual");
        }));
        EXPECT_EQ(report.diffs.size(), n_layers + 3) << name;
        EXPECT_TRUE(report.only_b.empty()) << name << ": " << fmt::format("{}", fmt::join(report.only_b, ", "));
    }
}

// ---- the xinfer binary ------------------------------------------------------------------------

TEST(XrayCli, DumpWritesEveryNamedIntermediate) {
    const Fixture f = load_fixture("qwen3_moe_f32");  // MoE layers 1 and 5, dense 0, 2, 3, 4
    const auto out = std::filesystem::temp_directory_path() / "xinfer_test_dump.safetensors";
    CommandResult run = run_xinfer(
        fmt::format("dump --model {} --prompt-ids {} --out {}", f.dir.string(), join_ids(f.prompt), out.string()));
    ASSERT_EQ(run.status, 0) << run.output;

    std::set<std::string> expected = {"embedding", "final_norm", "logits"};
    for (int layer = 0; layer < 6; ++layer) {
        for (const char* name : {"attn_input", "q", "k", "v", "attn_output", "attn_proj", "ffn_input", "ffn_output",
                                 "residual"})
            expected.insert(xray::tensor_name(name, layer));
        if (layer == 1 || layer == 5)
            for (const char* name : {"router_logits", "expert_ids", "expert_weights"})
                expected.insert(xray::tensor_name(name, layer));
    }
    auto file = SafetensorsFile::open(out);
    std::set<std::string> names;
    const int64_t n_tokens = int64_t(f.prompt.size());
    for (const TensorInfo& t : file->tensors()) {
        names.insert(t.name);
        EXPECT_EQ(t.dtype, t.name.ends_with("expert_ids") ? DType::i32 : DType::f32) << t.name;
        EXPECT_EQ(t.shape.front(), n_tokens) << t.name;
        if (t.name == "logits") {
            EXPECT_EQ(t.shape, (std::vector<int64_t>{n_tokens, f.vocab}));
        } else if (t.name == "layers.2.q") {
            EXPECT_EQ(t.shape, (std::vector<int64_t>{n_tokens, 4, 24}));
        } else if (t.name == "layers.5.expert_ids") {
            EXPECT_EQ(t.shape, (std::vector<int64_t>{n_tokens, 2}));
        }
    }
    EXPECT_EQ(names, expected);
    // The dumped logits are the model's logits (the golden reference, to f32 accuracy).
    const TensorInfo& logits = *std::find_if(file->tensors().begin(), file->tensors().end(),
                                              [](const TensorInfo& t) { return t.name == "logits"; });
    EXPECT_LE(relative_error(reinterpret_cast<const float*>(logits.data), f.logits.data(), f.logits.size()), 1e-4);
    const ActivationSet reread = xray::read_dump({out});
    EXPECT_EQ(reread.metadata.at("prompt_ids"), join_ids(f.prompt));
    EXPECT_EQ(reread.metadata.at("device"), "cpu");
    EXPECT_EQ(reread.metadata.at("model"), f.dir.string());
    EXPECT_EQ(reread.compute_dtype, DType::f32);

    // A dump compared against a live run of the same prompt: identical.
    CommandResult xray = run_xinfer(fmt::format("xray --model {} --prompt-ids {} --a-dump {} --b cpu", f.dir.string(),
                                                join_ids(f.prompt), out.string()));
    EXPECT_EQ(xray.status, 0) << xray.output;
    EXPECT_NE(xray.output.find("OK: all 63 compared tensors within threshold"), std::string::npos) << xray.output;
    // ... but not against another prompt.
    CommandResult other = run_xinfer(
        fmt::format("xray --model {} --prompt-ids 1,2,3 --a-dump {} --b cpu", f.dir.string(), out.string()));
    EXPECT_NE(other.status, 0);
    EXPECT_NE(other.output.find("was dumped for prompt"), std::string::npos) << other.output;

    // --names keeps only matching tensors.
    CommandResult filtered = run_xinfer(fmt::format("dump --model {} --prompt-ids {} --out {} --names 'attn_output$'",
                                                    f.dir.string(), join_ids(f.prompt), out.string()));
    ASSERT_EQ(filtered.status, 0) << filtered.output;
    file = SafetensorsFile::open(out);
    EXPECT_EQ(file->tensors().size(), 6u);
    for (const TensorInfo& t : file->tensors()) EXPECT_TRUE(t.name.ends_with(".attn_output")) << t.name;
    std::filesystem::remove(out);
}

TEST(XrayCli, CpuVsCpuExitsZero) {
    const Fixture f = load_fixture("mimo_hub_f32");
    CommandResult run =
        run_xinfer(fmt::format("xray --model {} --prompt-ids {} --a cpu --b cpu", f.dir.string(), join_ids(f.prompt)));
    EXPECT_EQ(run.status, 0) << run.output;
    EXPECT_NE(run.output.find("OK: all"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("relative error"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("NMSE"), std::string::npos) << run.output;
}

// The fault-injection plugin through the binary: names layer 2 attn_output, exits 1.
TEST(XrayCli, FaultyPluginIsNamedAndFails) {
    const Fixture f = load_fixture("mimo_hub_f32");
    const std::string env = fmt::format("XINFER_PLUGIN_PATH={} XINFER_FAULTY_OP=attention XINFER_FAULTY_LAYER=2 "
                                        "XINFER_FAULTY_REL=1e-2",
                                        XINFER_FAULTY_PLUGIN_DIR);
    CommandResult run = run_xinfer(
        fmt::format("xray --model {} --prompt-ids {} --a cpu --b faulty", f.dir.string(), join_ids(f.prompt)), env);
    std::cout << run.output;
    EXPECT_EQ(run.status, 1) << run.output;
    EXPECT_NE(run.output.find("FIRST over threshold (forward order): layer 2 attn_output: rel"), std::string::npos)
        << run.output;
}

TEST(XrayCli, AgainstTransformersReferenceIsClean) {
    const Fixture f = load_fixture("mimo_native_f32");
    CommandResult run = run_xinfer(fmt::format(
        "xray --model {} --prompt-ids {} --a cpu --b-dump {} --b-dump {}", f.dir.string(), join_ids(f.prompt),
        (f.dir / "reference_hidden.safetensors").string(), (f.dir / "reference.safetensors").string()));
    std::cout << run.output;
    EXPECT_EQ(run.status, 0) << run.output;
    EXPECT_NE(run.output.find("layers.0.attn_input"), std::string::npos) << "only-in-a list expected:\n" << run.output;

    CommandResult missing = run_xinfer(fmt::format("xray --model {} --prompt-ids 1,2 --a cpu", f.dir.string()));
    EXPECT_NE(missing.status, 0);
    EXPECT_NE(missing.output.find("--b DEVICE or --b-dump FILE"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace xinfer::test
