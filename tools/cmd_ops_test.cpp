// xinfer ops-test: every op of a backend against the CPU reference, over the grid of
// src/backend/op_cases.cpp (llama.cpp's test-backend-ops, for xinfer's fused ops).
//
//   xinfer ops-test                          CPU against CPU: a quick smoke test of the harness
//   xinfer ops-test --backend cuda           the CUDA plugin against the CPU (bf16 activations)
//   xinfer ops-test --backend cuda --perf    MiMo-V2-Flash shapes, timed, next to the measured
//                                            copy bandwidth and matmul peak of the same device
//
// One line per case, `PASS|FAIL|UNSUPPORTED op(shape summary, act=...) nmse=... (threshold ...)`,
// then `N passed, M failed, K unsupported`. Exit status 1 on any failure (or, with --strict, on
// any unsupported case).
#include "backend/op_cases.h"
#include "backend/op_desc.h"
#include "commands.h"
#include "device_limits.h"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <regex>

namespace xinfer::cli {
namespace {

using namespace op_cases;


std::string activation_list(const Backend& device) {
    std::string text;
    for (DType d : activation_candidates(device)) text += (text.empty() ? "" : "|") + std::string(dtype_name(d));
    return text;
}

void print_line(const std::string& line) {
    fmt::print("{}\n", line);
    std::fflush(stdout);
}

struct Selection {
    std::vector<std::string> ops;
    std::string filter;

    std::vector<OpCase> apply(std::vector<OpCase> cases) const {
        for (const std::string& op : ops) {
            bool known = false;
            for (int type = 1; type < XINFER_OP_COUNT; ++type) known = known || op == op_type_name(type);
            if (!known) {
                std::string names;
                for (int type = 1; type < XINFER_OP_COUNT; ++type) names += (type > 1 ? ", " : "") + std::string(op_type_name(type));
                fail("--op {}: no such op (ops: {})", op, names);
            }
        }
        std::regex pattern;
        try {
            pattern = std::regex(filter);
        } catch (const std::regex_error& e) {
            fail("--filter '{}': not a valid regular expression ({})", filter, e.what());
        }
        std::vector<OpCase> selected;
        for (OpCase& c : cases) {
            const bool op_ok = ops.empty() || std::find(ops.begin(), ops.end(), c.op) != ops.end();
            if (op_ok && (filter.empty() || std::regex_search(c.description, pattern))) selected.push_back(std::move(c));
        }
        return selected;
    }
};

// ---- correctness ---------------------------------------------------------------------------------

int run_correctness(Backend& reference, Backend& device, const std::vector<OpCase>& cases, bool strict) {
    print_line(fmt::format("ops-test: {} ({}) against the CPU reference, activations {}; {} cases", device.name(),
                           device.props().name, activation_list(device), cases.size()));
    int passed = 0, failed = 0, unsupported = 0;
    std::vector<std::string> failures;
    for (const OpCase& c : cases) {
        CaseResult result;
        bool has_activations = true;
        try {
            const CaseData data = c.build();
            has_activations = std::any_of(data.tensors.begin(), data.tensors.end(),
                                          [](const CaseTensor& t) { return t.activation; });
            result = check_case(c, data, reference, device);
        } catch (const std::exception& e) {
            result.status = CaseResult::fail;
            result.message = fmt::format("building the case failed: {}", e.what());
        }
        // Ops without activation tensors (convert, moe_route) are labelled as they are.
        auto label = [&](const std::string& activation) {
            return has_activations ? with_activation(c.description, activation) : c.description;
        };
        const std::string activation(dtype_name(result.activation));
        switch (result.status) {
            case CaseResult::pass:
                ++passed;
                print_line(fmt::format("PASS  {} {}", label(activation), format_checks(result)));
                break;
            case CaseResult::fail: {
                ++failed;
                const std::string line = fmt::format("FAIL  {} {}", label(activation), format_checks(result));
                failures.push_back(line);
                print_line(line);
                break;
            }
            case CaseResult::unsupported:
                ++unsupported;
                print_line(fmt::format("UNSUPPORTED  {} supports_op = 0", label(activation_list(device))));
                break;
        }
    }
    if (!failures.empty()) {
        print_line(fmt::format("\n{} failed case(s):", failures.size()));
        for (const std::string& line : failures) print_line("  " + line);
    }
    print_line(fmt::format("{} passed, {} failed, {} unsupported", passed, failed, unsupported));
    return failed > 0 || (strict && unsupported > 0) ? 1 : 0;
}

// ---- perf ----------------------------------------------------------------------------------------------

std::string percent(double value, double limit) {
    return limit > 0 ? fmt::format("{:5.1f}%", 100.0 * value / limit) : std::string("  n/a");
}

int run_perf(Backend& device, const std::vector<OpCase>& cases, double target_seconds) {
    print_line(fmt::format("ops-test --perf: {} ({}), activations {}; {} cases", device.name(), device.props().name,
                           activation_list(device), cases.size()));
    const double bandwidth = device.measure_copy_bandwidth_gbps();
    const MatmulPeak peak = measure_matmul_peak(device);
    print_line(fmt::format("copy bandwidth {:.1f} GB/s (read + write, measured now)", bandwidth));
    print_line(fmt::format("matmul peak {:.3g} TFLOP/s ({})", peak.tflops, peak.what));
    int measured = 0, unsupported = 0, skipped = 0, failed = 0;
    for (const OpCase& c : cases) {
        try {
            const CaseData data = c.build();
            const std::optional<DType> activation = pick_activation(data, device);
            if (!activation) {
                ++unsupported;
                print_line(fmt::format("UNSUPPORTED  {} supports_op = 0", with_activation(c.description, activation_list(device))));
                continue;
            }
            const std::string description = with_activation(c.description, std::string(dtype_name(*activation)));
            const uint64_t bytes = case_bytes(data, *activation);
            const uint64_t free_bytes = device.props().free_memory;
            if (free_bytes > 0 && double(bytes) > 0.8 * double(free_bytes)) {
                ++skipped;
                print_line(fmt::format("SKIP  {} needs {:.1f} GB, the device has {:.1f} GB free", description, bytes / 1e9,
                                       free_bytes / 1e9));
                continue;
            }
            PreparedCase prepared(data, device, *activation, false);
            prepared.reset();
            int iterations = 0;
            const double ms = time_op(device, prepared.op(), target_seconds, &iterations);
            const OpCost cost = op_cost(data, prepared.op());
            const double gbps = cost.bytes / (ms * 1e-3) / 1e9;
            const double tflops = cost.flops / (ms * 1e-3) / 1e12;
            std::string line = fmt::format("PERF  {:<120} {:10.4f} ms ({:4} runs) {:9.1f} GB/s ({} of copy)", description,
                                           ms, iterations, gbps, percent(gbps, bandwidth));
            if (cost.flops > 0) line += fmt::format(" {:9.3g} TFLOP/s ({} of matmul peak)", tflops, percent(tflops, peak.tflops));
            print_line(line);
            ++measured;
        } catch (const std::exception& e) {
            ++failed;
            print_line(fmt::format("FAIL  {} {}", c.description, e.what()));
        }
    }
    print_line(fmt::format("{} measured, {} failed, {} unsupported, {} skipped", measured, failed, unsupported, skipped));
    return failed > 0 ? 1 : 0;
}

}  // namespace

void add_ops_test_command(CLI::App& app) {
    struct Options {
        std::string backend = "cpu";
        Selection selection;
        bool perf = false;
        bool strict = false;
        bool list = false;
        double seconds = 0.25;
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand(
        "ops-test", "Check every op of a backend against the CPU reference (NMSE per op and dtype), or time it (--perf)");
    cmd->add_option("--backend", options->backend,
                    "Backend under test: cpu (against a second CPU instance), or a plugin name[:device] such as cuda")
        ->default_val("cpu");
    cmd->add_option("--op", options->selection.ops, "Only these ops (comma-separated op names, e.g. attention,matmul)")
        ->delimiter(',');
    cmd->add_option("--filter", options->selection.filter, "Only cases whose description matches this regular expression");
    cmd->add_flag("--perf", options->perf,
                  "Time the MiMo-V2-Flash-shaped perf grid instead: GB/s and TFLOP/s against the measured copy "
                  "bandwidth and matmul peak");
    cmd->add_option("--seconds", options->seconds, "--perf: target time per case")->default_val(0.25);
    cmd->add_flag("--strict", options->strict, "Unsupported cases fail too (exit status 1)");
    cmd->add_flag("--list", options->list, "List the selected cases without running them");
    cmd->callback([options] {
        std::vector<OpCase> cases = options->selection.apply(options->perf ? perf_cases() : correctness_cases());
        if (options->list) {
            for (const OpCase& c : cases) print_line(c.description);
            print_line(fmt::format("{} cases", cases.size()));
            return;
        }
        std::unique_ptr<Backend> device = make_backend(options->backend);
        int status = 0;
        if (options->perf) {
            status = run_perf(*device, cases, options->seconds);
        } else {
            std::unique_ptr<Backend> reference = make_cpu_backend();
            status = run_correctness(*reference, *device, cases, options->strict);
        }
        if (status != 0) throw CLI::RuntimeError(status);
    });
}

}  // namespace xinfer::cli
