// PLACEHOLDER (session 2): replaced by the mtp drafter.
#include "core/status.h"
#include "spec/drafter.h"

namespace xinfer {

std::unique_ptr<Drafter> make_mtp_drafter(const SpeculativeConfig&, const DrafterContext&) {
    fail("speculative method mtp is not implemented yet");
}

}  // namespace xinfer
