// PLACEHOLDER (session 2): replaced by the dflash drafter.
#include "core/status.h"
#include "spec/drafter.h"

namespace xinfer {

std::unique_ptr<Drafter> make_dflash_drafter(const SpeculativeConfig&, const DrafterContext&) {
    fail("speculative method dflash is not implemented yet");
}

}  // namespace xinfer
