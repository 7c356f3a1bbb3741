#include "core/status.h"
#include "spec/drafter.h"

namespace xinfer {

std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& config, const DrafterContext& context) {
    if (config.method == "ngram") return make_ngram_drafter(config);
    if (config.method == "dflash") return make_dflash_drafter(config, context);
    if (config.method == "mtp") return make_mtp_drafter(config, context);
    fail("speculative method \"{}\": expected dflash, mtp or ngram", config.method);
}

}  // namespace xinfer
