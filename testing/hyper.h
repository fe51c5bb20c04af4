// The AdamW hyper-parameters the daemon tests use (lr 1e-2, betas 0.9 / 0.999, eps 1e-8).
#pragma once

#include "stallfree/v1/offload.pb.h"

namespace stallfree {
namespace testing {

inline v1::AdamWHyper TestHyper(double weight_decay) {
  v1::AdamWHyper h;
  h.set_lr(1e-2);
  h.set_beta1(0.9);
  h.set_beta2(0.999);
  h.set_eps(1e-8);
  h.set_weight_decay(weight_decay);
  return h;
}

}  // namespace testing
}  // namespace stallfree
