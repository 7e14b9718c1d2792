// Activation recomputation: what a training forward keeps for backward and what backward re-runs
// instead (`packmoe train --recompute`). Invariant: every mode gives the same bytes as kNone (a
// recomputed op is the same op on the same bytes; nothing a forward counts is counted twice).
#pragma once

namespace packmoe {

enum class Recompute {
  kNone,       // every activation a backward reads is kept from the forward
  kSelective,  // the attention core (o, lse) and the MLPs' SwiGLU outputs are re-run in backward
  kFull,       // each decoder layer keeps only its input; backward re-runs the layer's forward
};

}  // namespace packmoe
