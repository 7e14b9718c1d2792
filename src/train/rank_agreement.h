// What the ranks of a data-parallel job must agree on around checkpoints: one Status for all (so
// every rank takes the same branch and none is left waiting in a collective), a string chosen by
// one rank (the checkpoint's temporary directory), and a small vector from every rank (their SR
// offsets). Invariant: every function is a collective (every rank calls it, in the same order),
// and its buffers live in the communicator's backend memory, so it works over MPI and NCCL alike.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "dist/communicator.h"

namespace packmoe::train {

// What every rank learns of all ranks' statuses.
struct Agreement {
  int failures = 0;       // how many ranks failed
  int first_failed = -1;  // the lowest failing rank; -1 when none did
  std::string message;    // its message, as it wrote it
};
Agreement agree(Communicator& comm, const Status& mine);

// Every rank gets the same result: ok when every rank's `mine` is ok, else the error of the lowest
// failing rank ("rank r: " + its message when r > 0).
Status agree_on_status(Communicator& comm, const Status& mine);

// `root`'s `value` on every rank.
std::string broadcast_string(Communicator& comm, const std::string& value, int root);

}  // namespace packmoe::train
