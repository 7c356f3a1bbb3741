// A fault-injection backend for xray's tests: exactly the CPU backend, except that the output of
// one op type at one layer is perturbed by deterministic noise of a given size relative to that
// output's largest magnitude. xray comparing the CPU against it must name that (layer, tensor)
// first.
//
// Two ways to get it:
//  - in process: faulty_backend_api(spec) wraps the built-in CPU table (cpu_backend_api());
//    make_faulty_backend(spec) returns a Backend over it;
//  - as a plugin: libxinfer-faulty.so (built by tests/CMakeLists.txt with its own copy of the CPU
//    backend), opened with `--device faulty`; the fault is read from the environment when the
//    plugin is loaded:
//        XINFER_FAULTY_OP     op name as op_type_name() spells it (default "attention")
//        XINFER_FAULTY_LAYER  layer tag of the op (default 2)
//        XINFER_FAULTY_REL    noise amplitude relative to max|output| (default 1e-2)
#pragma once

#include "backend/backend.h"

#include <memory>

namespace xinfer::test {

struct FaultSpec {
    int op_type = XINFER_OP_ATTENTION;  // xinfer_op_type whose dst[0] is perturbed
    int layer = 2;                      // only ops carrying this layer tag (Backend::set_layer)
    double relative = 1e-2;             // noise amplitude / max|dst[0]|
};

// The wrapped table. The fault spec is process-wide (C function pointers carry no state): the
// latest call's spec applies to every faulty backend. Not thread-safe; for tests.
const xinfer_backend_api* faulty_backend_api(const FaultSpec& spec);
std::unique_ptr<Backend> make_faulty_backend(const FaultSpec& spec);
// Ops perturbed so far (all faulty contexts together).
int faulty_backend_hits();

}  // namespace xinfer::test
