// The communicator of a process that trains alone: one rank, in the memory of any backend, so the
// trainer and its optimizer run the same code for 1..N ranks. Invariant: every collective is a
// copy of the caller's bytes (or nothing, in place), so one rank's results are those of the same
// code without communication.
#pragma once

#include <memory>

#include "dist/communicator.h"

namespace packmoe {

// dist/communicator.h's local communicator in the backend's memory, without call verification or
// a watchdog: one rank cannot disagree with itself nor wait for another. Its split() returns
// another such communicator (an expert-parallel group of one).
std::unique_ptr<Communicator> make_single_rank_communicator(Backend& backend);

}  // namespace packmoe
