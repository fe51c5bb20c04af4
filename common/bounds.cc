#include "common/bounds.h"

#include "absl/strings/str_cat.h"

namespace stallfree {

bool MulOverflow(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
bool AddOverflow(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}
bool AlignUp(uint64_t value, uint64_t align, uint64_t* out) {
  uint64_t t;
  if (!AddOverflow(value, align - 1, &t)) return false;
  *out = t & ~(align - 1);
  return true;
}

absl::Status CheckRange(uint64_t offset, uint64_t length, uint64_t size,
                        const std::string& field) {
  // offset <= size and length <= size - offset: no addition, so no overflow.
  if (offset > size || length > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": range [offset ", offset,
                                                   ", length ", length,
                                                   ") is outside the slot of ", size,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace stallfree
