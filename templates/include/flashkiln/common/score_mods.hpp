// What a score kernel's variant compiles in of the functional axes that change the scores
// (runtime/descriptor.py: causal, bias, window, softcap): one base of every score kernel's
// traits, so that kernels read T::kCausal, T::kBias, ... and a new such axis is one line here.
#pragma once

#include <flashkiln/common/visibility.hpp>

namespace flashkiln {

template <Causal kCausal_, bool kBias_, bool kWindow_, bool kSoftcap_>
struct ScoreMods {
  static constexpr Causal kCausal = kCausal_;
  static constexpr bool kBias = kBias_;  // an additive score bias: the family's bias tiles
  // A sliding window (visibility.hpp): its reach is the call's (params' window_left/right).
  static constexpr bool kWindow = kWindow_;
  // Logit softcapping (softcap.hpp): its cap is the call's (params' softcap_scale).
  static constexpr bool kSoftcap = kSoftcap_;
};

}  // namespace flashkiln
