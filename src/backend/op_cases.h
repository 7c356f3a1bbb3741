// Op cases: the grid `xinfer ops-test` runs (test-backend-ops style), as plain data that tests
// and tools reuse. A case is a description plus a deterministic builder of its inputs; running
// it means building the same op on two backends (the CPU reference and the backend under test),
// poisoning every output with NaN on both, running, and comparing each output by NMSE
// (Σ(dev − ref)² / Σ ref²) against the case's thresholds, or exactly for ids and copies.
//
// Activation dtype. A case marks its activation tensors (x, q, out, KV caches ...) instead of
// fixing their dtype: the reference always gets f32 (the CPU's activation dtype), the device
// gets bf16 when it is an accelerator (props().host_memory == 0) and accepts the op that way,
// else f32. Input values are first rounded to the device's dtype, so both sides compute from
// identical numbers; the reference output is rounded to the device's output dtype before the
// comparison (a correctly rounded result is the best any device can return).
//
// Thresholds are per op and per precision class, the lowest-precision float dtype among the
// tensors the device sees (an f32 matmul with bf16 weights is in the bf16 class: a device may
// run the products on bf16 tensor cores). See kTolerance* in op_cases.cpp for the table and its
// justification.
#pragma once

#include "backend/backend.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace xinfer::op_cases {

// Where a case tensor goes in the xinfer_op.
struct Slot {
    enum Kind : uint8_t { none, src, dst, cu_q_lens, kv_lens, positions, page_table, slot_mapping };
    Kind kind = none;
    int index = 0;  // src[index] / dst[index]
};
inline Slot src(int i) { return {Slot::src, i}; }
inline Slot dst(int i) { return {Slot::dst, i}; }

enum class Access : uint8_t {
    input,   // uploaded before the run
    output,  // poisoned with NaN (0xff bytes; -1 for i32) before the run, compared after
    inout,   // uploaded before the run (the op updates it in place), compared after
};
enum class Compare : uint8_t { none, nmse, exact };

struct CaseTensor {
    std::string name;  // role, as in the op's description ("x", "k_cache")
    Slot slot;
    Access access = Access::input;
    Compare compare = Compare::none;
    bool activation = false;   // dtype chosen by the harness (see above); else `dtype`
    DType dtype = DType::f32;
    std::vector<int64_t> shape;
    std::vector<float> values;    // float tensors: values before rounding to the tensor's dtype (NaN allowed)
    std::vector<int32_t> ints;    // i32 tensors
    // Byte contents uploaded as they are, instead of `values` (fp8 KV caches: e4m3 values with
    // their f32 row scales in each page, src/backend/cpu/kv_fp8.h). The tensor then occupies
    // raw.size() bytes, whatever its shape says, and compares byte by byte.
    std::vector<uint8_t> raw;
    // A view into another tensor's memory (one layer's K inside a KV pool with page_stride):
    // no memory or values of its own.
    int view_of = -1;             // index of the backing tensor in CaseData::tensors
    int64_t view_offset = 0;      // elements from the start of the backing tensor
    // Perf shapes too large to build on the host: filled on the device with values uniform in
    // ±bulk_random (instead of `values`).
    float bulk_random = 0.f;
    // A tensor only one side sees (block-scaled fp8 weights for the device, their dequantized f32
    // values for the reference, which has no fp8 MATMUL): both are built, in the same slot.
    enum class Side : uint8_t { both, reference, device };
    Side side = Side::both;

    int64_t numel() const;
    // Device bytes at this dtype (raw.size() for raw tensors).
    size_t bytes(DType dtype) const;
};

struct CaseData {
    xinfer_op op{};                 // type, params and batch scalars; tensors are set by the harness
    std::vector<CaseTensor> tensors;
};

// NMSE thresholds by precision class (0: compare exactly).
struct Tolerance {
    double f32, f16, bf16;
    double for_class(DType precision) const;
};

struct OpCase {
    std::string op;           // op_type_name(): "attention"
    std::string description;  // "attention(seqs=3, T=7, heads=16/2, d=192/128, window=32, sinks, page=16)"
    Tolerance tolerance;
    std::function<CaseData()> build;  // deterministic (fixed seed); may allocate a lot, call once per run
};

// The correctness grid: every op over shapes, dtypes and modes (odd sizes, every attention
// variant, GQA 1/8/16, MiMo head dims, paged and page-strided caches, ...). CPU vs CPU runs it
// in well under 30 s on two cores.
std::vector<OpCase> correctness_cases();
// Realistic MiMo-V2-Flash shapes (hidden 4096, q 12288, kv 4/8 heads of 192/128, experts 2048
// wide, vocab 152576), decode T=1 and prefill T=4096, for --perf. Large weights and caches are
// filled on the device.
std::vector<OpCase> perf_cases();
// y[T, N] = x[T, K] · w[N, K]ᵀ with weights of `w_dtype` (the perf harness times a large one to
// measure the device's matmul peak).
OpCase matmul_case(int64_t T, int64_t N, int64_t K, DType w_dtype, uint32_t seed);

// ---- running cases ---------------------------------------------------------------------------------

// A case's tensors allocated and filled on one backend, with the op pointing at them.
class PreparedCase {
public:
    // Resolves activation tensors to `activation` (f32, bf16 or f16) on `backend`;
    // `reference_side` = true gives f32 activations holding the values rounded to `activation`.
    PreparedCase(const CaseData& data, Backend& backend, DType activation, bool reference_side);
    const xinfer_op& op() const { return op_; }
    // Uploads inputs/inouts and poisons outputs (again), then synchronizes.
    void reset();
    // Host copy (as f32, or i32 widened to float exactly) of tensor i after a run.
    std::vector<float> download(size_t i);
    DType dtype_of(size_t i) const { return dtypes_[i]; }
    uint64_t allocated_bytes() const { return allocated_; }

private:
    const CaseData& data_;
    Backend& backend_;
    DType activation_;
    bool reference_side_;
    std::vector<DType> dtypes_;
    std::vector<Buffer> buffers_;
    std::vector<void*> pointers_;
    xinfer_op op_{};
    uint64_t allocated_ = 0;
};

// The op with every tensor's dtype resolved for `activation` and data pointers left NULL
// (what supports_op is asked about).
xinfer_op resolve_op(const CaseData& data, DType activation, bool reference_side);
// The lowest-precision float dtype among the op's tensors as the device sees them.
DType precision_class(const CaseData& data, DType activation);
// Bytes of device memory the case needs at this activation dtype.
uint64_t case_bytes(const CaseData& data, DType activation);

struct TensorCheck {
    std::string name;
    Compare compare = Compare::nmse;
    double nmse = 0;           // nmse comparisons
    double threshold = 0;
    int64_t mismatches = 0;    // exact comparisons: elements that differ
    int64_t non_finite = 0;    // NaN/inf in the device's output (or the reference's)
    int64_t count = 0;
    bool pass = false;
};

struct CaseResult {
    enum Status { pass, fail, unsupported } status = fail;
    DType activation = DType::f32;
    std::vector<TensorCheck> checks;
    std::string message;       // why it failed (exception text), or empty
};

// Runs `c` on both backends and compares. Never throws for backend errors: they become a FAIL
// with the message. A case the device's supports_op refuses at every activation dtype is
// UNSUPPORTED; one that supports_op accepts but run_op then refuses is a FAIL.
CaseResult check_case(const OpCase& c, const CaseData& data, Backend& reference, Backend& device);
// "nmse=1.2e-09 (threshold 1e-07)" / "exact: 0 of 231 differ"; several outputs are named.
std::string format_checks(const CaseResult& result);

// Activation dtypes to try on a device, in order of preference.
std::vector<DType> activation_candidates(const Backend& device);
// The first candidate the device supports for this case, if any.
std::optional<DType> pick_activation(const CaseData& data, Backend& device);

// Work of one run of the op as resolved: bytes that must move (inputs read + outputs written,
// in-place tensors twice, only the KV and expert weights actually touched) and FLOPs (matmul-
// like work only: 0 for elementwise ops).
struct OpCost {
    double bytes = 0;
    double flops = 0;
};
OpCost op_cost(const CaseData& data, const xinfer_op& resolved);

}  // namespace xinfer::op_cases
