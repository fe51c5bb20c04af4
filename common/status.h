// Status helpers. Debian's Abseil (20220623) has absl::Status/StatusOr but not the
// RETURN_IF_ERROR / ASSIGN_OR_RETURN macros, so they live here.
#pragma once

#include <cerrno>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define SF_CONCAT_INNER(a, b) a##b
#define SF_CONCAT(a, b) SF_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::absl::Status sf_status_ = (expr);            \
    if (!sf_status_.ok()) return sf_status_;       \
  } while (0)

// ASSIGN_OR_RETURN(auto x, F()) : declares x from a StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  SF_ASSIGN_OR_RETURN_IMPL(SF_CONCAT(sf_statusor_, __LINE__), lhs, expr)
#define SF_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

namespace stallfree {

// A status for a failed system call: names the call, the object and errno.
// Also logs it at ERROR level (NCCL habit: every system-call failure is logged).
absl::Status ErrnoStatus(const std::string& call, const std::string& object, int err = errno);

}  // namespace stallfree
