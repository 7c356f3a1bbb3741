// The plugin boundary from the outside: the out-of-tree example backend (tests/plugin/
// example_backend, a separate CMake project) loaded through make_backend and XINFER_PLUGIN_PATH,
// `xinfer ops-test` run against it and against the CPU, and the loader's error messages.
#include "backend/backend.h"
#include "backend/op_cases.h"
#include "backend/op_desc.h"

#include <fmt/core.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace xinfer::test {
namespace {

const std::string kPluginDir = XINFER_EXAMPLE_PLUGIN_DIR;

struct CommandResult {
    int status = -1;
    std::string output;  // stdout and stderr
};

// Runs the xinfer binary with `env` prepended (VAR=value ...).
CommandResult run_xinfer(const std::string& args, const std::string& env = "") {
    const std::string command = fmt::format("{} {} {} 2>&1", env, XINFER_BINARY, args);
    FILE* pipe = popen(command.c_str(), "r");
    if (!pipe) throw std::runtime_error("popen failed: " + command);
    CommandResult result;
    std::array<char, 4096> buffer;
    while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) result.output.append(buffer.data(), n);
    const int status = pclose(pipe);
    result.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return result;
}

std::string plugin_env(const std::string& extra = "") {
    return "XINFER_PLUGIN_PATH=" + kPluginDir + (extra.empty() ? "" : " " + extra);
}

// One `PASS|FAIL|UNSUPPORTED  op(...) ...` line of ops-test.
struct CaseLine {
    std::string status, op, text;
};

struct OpsTestOutput {
    std::vector<CaseLine> cases;
    int passed = -1, failed = -1, unsupported = -1;  // from the summary line
    int count(const std::string& status, const std::string& op = "") const {
        int n = 0;
        for (const CaseLine& c : cases) n += c.status == status && (op.empty() || c.op == op);
        return n;
    }
};

OpsTestOutput parse(const std::string& output) {
    OpsTestOutput parsed;
    const std::regex case_line(R"(^(PASS|FAIL|UNSUPPORTED)  ([a-z_]+)\(.*$)");
    const std::regex summary(R"(^(\d+) passed, (\d+) failed(, (\d+) unsupported)?$)");
    std::istringstream lines(output);
    std::string line;
    bool in_failure_list = false;
    while (std::getline(lines, line)) {
        std::smatch m;
        if (line.find("failed case(s):") != std::string::npos) in_failure_list = true;
        if (!in_failure_list && std::regex_match(line, m, case_line)) parsed.cases.push_back({m[1], m[2], line});
        if (std::regex_match(line, m, summary)) {
            parsed.passed = std::stoi(m[1]);
            parsed.failed = std::stoi(m[2]);
            parsed.unsupported = m[4].matched ? std::stoi(m[4]) : 0;
        }
    }
    return parsed;
}

void expect_error(const std::function<void()>& body, const std::vector<std::string>& fragments) {
    try {
        body();
        ADD_FAILURE() << "expected an error mentioning " << fragments.front();
    } catch (const Error& e) {
        const std::string message = e.what();
        for (const std::string& f : fragments) EXPECT_NE(message.find(f), std::string::npos) << message;
    }
}

class ExamplePlugin : public ::testing::Test {
protected:
    static void SetUpTestSuite() { setenv("XINFER_PLUGIN_PATH", kPluginDir.c_str(), 1); }
};

// ---- loading ------------------------------------------------------------------------------------

TEST_F(ExamplePlugin, LoadsThroughMakeBackendAndRunsOps) {
    std::unique_ptr<Backend> backend = make_backend("example");
    ASSERT_NE(backend, nullptr);
    EXPECT_EQ(backend->name(), "example:0");
    EXPECT_STREQ(backend->api().name, "example");
    EXPECT_EQ(backend->api().abi_version, uint32_t(XINFER_BACKEND_ABI_VERSION));
    EXPECT_STREQ(backend->props().name, "example host backend");
    EXPECT_EQ(backend->props().host_memory, 1);
    EXPECT_GT(backend->props().total_memory, 0u);
    EXPECT_FALSE(backend->has_graphs());
    EXPECT_FALSE(backend->has_events());
    EXPECT_GT(backend->measure_copy_bandwidth_gbps(), 0.0);

    // rmsnorm through the C++ facade, against the CPU.
    std::unique_ptr<Backend> cpu = make_backend("cpu");
    const std::vector<float> x = {1.f, -2.f, 3.f, 0.5f, 4.f, -1.f}, w = {1.f, 0.5f, 2.f};
    std::vector<float> got(6), want(6);
    for (auto [backend_ptr, result] : {std::pair{backend.get(), &got}, std::pair{cpu.get(), &want}}) {
        Backend& b = *backend_ptr;
        Buffer xb = b.alloc(x.size() * 4), wb = b.alloc(w.size() * 4), ob = b.alloc(x.size() * 4);
        const Tensor xt(xb.data(), DType::f32, {2, 3}), wt(wb.data(), DType::f32, {3}), ot(ob.data(), DType::f32, {2, 3});
        b.upload(xt, x.data());
        b.upload(wt, w.data());
        b.rmsnorm(xt, wt, 1e-6f, ot);
        b.download(ot, result->data());
        b.synchronize();
    }
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6f * std::fabs(want[i])) << i;

    // An op the example does not implement is refused by supports_op, and run() says so.
    Buffer qb = backend->alloc(64);
    const Tensor t(qb.data(), DType::f32, {4, 4});
    xinfer_op op{};
    op.type = XINFER_OP_SWIGLU;
    op.layer = 3;
    op.src[0] = xinfer_tensor{qb.data(), XINFER_DTYPE_F32, 2, {4, 4}};
    op.dst[0] = xinfer_tensor{qb.data(), XINFER_DTYPE_F32, 2, {4, 2}};
    EXPECT_FALSE(backend->supports(op));
    expect_error([&] { backend->run(op); }, {"example:0", "does not support", "swiglu (layer 3)", "not implemented"});
}

TEST_F(ExamplePlugin, LoaderErrorsNameTheProblem) {
    expect_error([] { make_backend("example-badabi"); },
                 {"libxinfer-example-badabi.so", "ABI version 999", "needs version " + std::to_string(XINFER_BACKEND_ABI_VERSION),
                  "rebuild the plugin"});
    expect_error([] { make_backend("example-nosym"); },
                 {"libxinfer-example-nosym.so", "does not export xinfer_backend_init"});
    expect_error([] { make_backend("nosuchvendor"); },
                 {"libxinfer-nosuchvendor.so", "not found", kPluginDir, "XINFER_PLUGIN_PATH"});
    expect_error([] { make_backend("example:1"); }, {"example:1", "1 device(s)"});
    // The CLI reports the same, and fails.
    const CommandResult run = run_xinfer("ops-test --backend example-badabi", plugin_env());
    EXPECT_NE(run.status, 0);
    EXPECT_NE(run.output.find("ABI version 999"), std::string::npos) << run.output;
}

// ---- ops-test against the example backend ------------------------------------------------------------

TEST_F(ExamplePlugin, OpsTestPassesImplementedOpsAndListsTheRestUnsupported) {
    const CommandResult run = run_xinfer("ops-test --backend example", plugin_env());
    ASSERT_EQ(run.status, 0) << run.output;
    const OpsTestOutput out = parse(run.output);
    EXPECT_EQ(out.count("FAIL"), 0) << run.output;
    // The five implemented ops pass in every case the example accepts ...
    for (const char* op : {"embedding", "rmsnorm", "add", "scale", "matmul"}) EXPECT_GT(out.count("PASS", op), 0) << op;
    for (const CaseLine& c : out.cases)
        if (c.op == "matmul") {
            EXPECT_EQ(c.status, c.text.find("w=f32") != std::string::npos ? "PASS" : "UNSUPPORTED") << c.text;
        }
    // ... and everything else is listed, not skipped.
    for (const char* op : {"add_rmsnorm", "rope", "swiglu", "convert", "kv_store", "attention", "moe_route",
                           "moe_experts", "argmax", "sample"}) {
        EXPECT_EQ(out.count("PASS", op), 0) << op;
        EXPECT_GT(out.count("UNSUPPORTED", op), 0) << op;
    }
    const int total = int(op_cases::correctness_cases().size());
    EXPECT_EQ(int(out.cases.size()), total);
    EXPECT_EQ(out.passed, out.count("PASS"));
    EXPECT_EQ(out.failed, 0);
    EXPECT_EQ(out.unsupported, out.count("UNSUPPORTED"));
    EXPECT_EQ(out.passed + out.unsupported, total);
}

TEST_F(ExamplePlugin, StrictTurnsUnsupportedIntoFailure) {
    const CommandResult run = run_xinfer("ops-test --backend example --op attention --strict", plugin_env());
    EXPECT_EQ(run.status, 1) << run.output;
    const OpsTestOutput out = parse(run.output);
    EXPECT_EQ(out.passed, 0);
    EXPECT_EQ(out.failed, 0);
    EXPECT_GT(out.unsupported, 0);
    EXPECT_EQ(out.unsupported, out.count("UNSUPPORTED", "attention"));
}

// A backend whose memory is not host memory gets bf16 activations where it accepts them; the
// example can pretend to be one, which exercises the harness's bf16 path without a GPU.
TEST_F(ExamplePlugin, DeviceMemoryBackendsRunBf16Activations) {
    const CommandResult run = run_xinfer("ops-test --backend example --op embedding,rmsnorm,add,scale,matmul",
                                         plugin_env("XINFER_EXAMPLE_DEVICE_MEMORY=1"));
    ASSERT_EQ(run.status, 0) << run.output;
    const OpsTestOutput out = parse(run.output);
    EXPECT_GT(out.count("PASS"), 10);
    EXPECT_EQ(out.count("FAIL"), 0);
    for (const CaseLine& c : out.cases)
        if (c.status == "PASS") {
            EXPECT_NE(c.text.find("act=bf16"), std::string::npos) << c.text;
        }
}

TEST_F(ExamplePlugin, OpsTestCatchesUnwrittenOutputsAndWrongValues) {
    // One element of every rmsnorm output left unwritten: the NaN poison shows it.
    CommandResult run = run_xinfer("ops-test --backend example --op rmsnorm", plugin_env("XINFER_EXAMPLE_FAULT=rmsnorm_unwritten"));
    EXPECT_EQ(run.status, 1) << run.output;
    OpsTestOutput out = parse(run.output);
    EXPECT_GT(out.count("FAIL", "rmsnorm"), 0);
    EXPECT_EQ(out.count("PASS", "rmsnorm"), 0) << run.output;
    for (const CaseLine& c : out.cases)
        if (c.status == "FAIL") {
            EXPECT_NE(c.text.find("1 NaN/inf"), std::string::npos) << c.text;
        }
    EXPECT_EQ(out.failed, out.count("FAIL"));

    // Outputs 0.1% off: NMSE 1e-6, ten times the f32 threshold.
    run = run_xinfer("ops-test --backend example --op matmul --filter w=f32", plugin_env("XINFER_EXAMPLE_FAULT=matmul_off"));
    EXPECT_EQ(run.status, 1) << run.output;
    out = parse(run.output);
    EXPECT_GT(out.count("FAIL", "matmul"), 0);
    EXPECT_EQ(out.count("PASS"), 0) << run.output;
    for (const CaseLine& c : out.cases) EXPECT_NE(c.text.find("nmse=1.00e-06 (threshold 1e-07)"), std::string::npos) << c.text;
}

TEST_F(ExamplePlugin, PerfModeTimesSupportedCases) {
    const CommandResult run =
        run_xinfer("ops-test --backend example --perf --op rmsnorm,attention --filter 'rows=1,|GA decode:' --seconds 0.05",
                   plugin_env());
    ASSERT_EQ(run.status, 0) << run.output;
    EXPECT_NE(run.output.find("copy bandwidth"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("matmul peak"), std::string::npos) << run.output;
    EXPECT_TRUE(std::regex_search(run.output, std::regex(R"(PERF  rmsnorm\(rows=1, .* ms .* GB/s)"))) << run.output;
    EXPECT_TRUE(std::regex_search(run.output, std::regex(R"(UNSUPPORTED  attention\(GA decode)"))) << run.output;
    EXPECT_NE(run.output.find("1 measured, 0 failed, 1 unsupported, 0 skipped"), std::string::npos) << run.output;
}

// ---- ops-test, CPU against CPU: the harness's smoke test -------------------------------------------

TEST(OpsTest, CpuAgainstCpuPassesEveryCase) {
    const CommandResult run = run_xinfer("ops-test");
    ASSERT_EQ(run.status, 0) << run.output;
    const OpsTestOutput out = parse(run.output);
    const int total = int(op_cases::correctness_cases().size());
    EXPECT_EQ(out.passed, total) << run.output;
    EXPECT_EQ(out.failed, 0);
    EXPECT_EQ(out.unsupported, 0);
    EXPECT_EQ(out.count("PASS"), total);
    // Every op of the ABI is in the grid.
    for (int type = 1; type < XINFER_OP_COUNT; ++type) EXPECT_GT(out.count("PASS", op_type_name(type)), 0) << type;
}

TEST(OpsTest, SelectsByOpAndRegexAndRejectsUnknownOps) {
    // Labels are matched at the start of the description: three fixed cases, whatever else the grid grows.
    CommandResult run = run_xinfer("ops-test --op attention --filter '^attention\\((sliding small|DFlash block|pool sliding):'");
    ASSERT_EQ(run.status, 0) << run.output;
    OpsTestOutput out = parse(run.output);
    EXPECT_EQ(out.count("PASS", "attention"), 3) << run.output;
    EXPECT_EQ(int(out.cases.size()), 3);

    run = run_xinfer("ops-test --op nosuchop");
    EXPECT_NE(run.status, 0);
    EXPECT_NE(run.output.find("--op nosuchop: no such op"), std::string::npos) << run.output;

    run = run_xinfer("ops-test --filter '('");
    EXPECT_NE(run.status, 0);
    EXPECT_NE(run.output.find("not a valid regular expression"), std::string::npos) << run.output;
}

// The grid covers what the brief of every op needs; cheap structural checks on the case data.
TEST(OpCases, GridsAreDeterministicAndCoverTheVariants) {
    const std::vector<op_cases::OpCase> cases = op_cases::correctness_cases();
    std::map<std::string, int> per_op;
    for (const op_cases::OpCase& c : cases) ++per_op[c.op];
    EXPECT_GE(per_op["attention"], 12);
    EXPECT_GE(per_op["matmul"], 16);
    auto has = [&](const std::string& op, const std::string& fragment) {
        for (const op_cases::OpCase& c : cases)
            if (c.op == op && c.description.find(fragment) != std::string::npos) return true;
        return false;
    };
    for (const char* fragment : {"window=", "sinks", "non-causal", "GQA 1)", "GQA 8)", "GQA 16)", "d=192/128", "d=24/16",
                                 "page_stride=", "q=32", "seqs=6"})
        EXPECT_TRUE(has("attention", fragment)) << fragment;
    for (const char* fragment : {"T=1,", "T=7,", "T=33,", "T=512,", "w=bf16", "w=f32", "K=255"})
        EXPECT_TRUE(has("matmul", fragment)) << fragment;
    EXPECT_TRUE(has("moe_route", "sigmoid+bias, groups"));
    EXPECT_TRUE(has("moe_route", "softmax"));

    // Correctness cases carry all their values (only perf shapes are filled on the device).
    for (const op_cases::OpCase& c : cases) {
        const op_cases::CaseData data = c.build();
        for (const op_cases::CaseTensor& t : data.tensors) {
            EXPECT_EQ(t.bulk_random, 0.f) << c.description << " " << t.name;
            if (t.access == op_cases::Access::output || t.view_of >= 0) continue;
            if (!t.raw.empty()) {  // fp8 caches: raw bytes, values and row scales
                EXPECT_GE(int64_t(t.raw.size()), t.numel()) << c.description << " " << t.name;
                continue;
            }
            EXPECT_EQ(int64_t(t.dtype == DType::i32 ? t.ints.size() : t.values.size()), t.numel())
                << c.description << " " << t.name;
        }
    }

    // Same seed, same data.
    for (const op_cases::OpCase& c : cases) {
        if (c.op != "attention" && c.op != "sample") continue;
        const op_cases::CaseData a = c.build(), b = c.build();
        ASSERT_EQ(a.tensors.size(), b.tensors.size());
        for (size_t i = 0; i < a.tensors.size(); ++i) {
            EXPECT_EQ(a.tensors[i].ints, b.tensors[i].ints) << c.description;
            ASSERT_EQ(a.tensors[i].values.size(), b.tensors[i].values.size());
            EXPECT_EQ(0, std::memcmp(a.tensors[i].values.data(), b.tensors[i].values.data(),
                                     a.tensors[i].values.size() * sizeof(float)))
                << c.description;  // bitwise: NaN sentinels included
        }
    }
}

}  // namespace
}  // namespace xinfer::test
