// libFuzzer entry of the json_config target (tests/fuzz/fuzz_targets.h); built only with
// -DPACKMOE_FUZZ=ON (clang): build-fuzz/fuzz_json_config -max_total_time=600 [corpus dir].
#include "fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return packmoe::fuzz::fuzz_json_config(data, size);
}
