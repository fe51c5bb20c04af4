// The kernels' AdamW configuration of a request's hyper-parameters at a step, for the daemon
// tests' own reference runs (the daemon's is PlanUpdate's, server/requests.h).
#pragma once

#include <cstdint>

#include "kernels/optimizer.h"
#include "stallfree/v1/offload.pb.h"

namespace stallfree {
namespace testing {

inline kernels::AdamWConfig ConfigOf(const v1::AdamWHyper& h, int64_t step) {
  kernels::AdamWConfig c;
  c.lr = h.lr();
  c.beta1 = h.beta1();
  c.beta2 = h.beta2();
  c.eps = h.eps();
  c.weight_decay = h.weight_decay();
  c.step = step;
  return c;
}

}  // namespace testing
}  // namespace stallfree
