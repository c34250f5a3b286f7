// Compile-time check of a parameter struct's layout against the one the Python runtime packs.
// NVRTC has no constexpr offsetof, so the generator renders a constexpr instance whose fields
// hold their 1-based index (floats by bit pattern) and the check reads the bytes back.
#pragma once

#include <cuda/std/array>
#include <cuda/std/bit>
#include <cuda/std/cstdint>

namespace flashkiln::abi {

// The marker stored in a float field: its bit pattern's low byte is `index`.
constexpr float float_marker(uint32_t index) { return cuda::std::bit_cast<float>(index); }

template <class Params>
constexpr auto bytes_of(Params const& p) {
  return cuda::std::bit_cast<cuda::std::array<unsigned char, sizeof(Params)>>(p);
}

}  // namespace flashkiln::abi
