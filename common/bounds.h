// Overflow-safe bounds checks for (offset, length) ranges inside a buffer of known size.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace stallfree {

// OK iff [offset, offset+length) lies inside [0, size), computed without overflow.
// `field` names the request field in the error message.
absl::Status CheckRange(uint64_t offset, uint64_t length, uint64_t size, const std::string& field);

// Sets *out = a*b; false on uint64 overflow.
bool MulOverflow(uint64_t a, uint64_t b, uint64_t* out);
// Sets *out = a+b; false on uint64 overflow.
bool AddOverflow(uint64_t a, uint64_t b, uint64_t* out);

// Rounds up to a multiple of `align` (a power of two); false on overflow.
bool AlignUp(uint64_t value, uint64_t align, uint64_t* out);

}  // namespace stallfree
