// Status helpers. Debian's Abseil (20220623) has absl::Status/StatusOr but not the
// RETURN_IF_ERROR / ASSIGN_OR_RETURN macros, so they live here: the one set for the whole tree.
//
//   RETURN_IF_ERROR(Fsync(fd));                                  // the error as it is
//   RETURN_IF_ERROR_CTX(comm->AllReduce(buf, n), "tpsp: ln grads"); // "tpsp: ln grads: <error>"
//   ASSIGN_OR_RETURN(Header h, ReadHeader(path));
//   ASSIGN_OR_RETURN_CTX(auto pos, ZigzagPositions(T, D, p), "rank ", p);
//
// The _CTX forms put the StrCat of their context arguments and ": " before the error's message;
// the code (what callers decide by) is kept. expr may be an absl::Status or
// an absl::StatusOr<T> in RETURN_IF_ERROR and RETURN_IF_ERROR_CTX.
#pragma once

#include <cerrno>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define SF_CONCAT_INNER(a, b) a##b
#define SF_CONCAT(a, b) SF_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status or StatusOr) is not OK.
#define RETURN_IF_ERROR(expr)                                                   \
  do {                                                                          \
    ::absl::Status sf_status_ = ::stallfree::status_internal::StatusOf(expr);   \
    if (!sf_status_.ok()) return sf_status_;                                    \
  } while (0)

// The same, with "<StrCat(context...)>: " before the message.
#define RETURN_IF_ERROR_CTX(expr, ...)                                                      \
  do {                                                                                      \
    ::absl::Status sf_status_ = ::stallfree::status_internal::StatusOf(expr);               \
    if (!sf_status_.ok())                                                                   \
      return ::stallfree::WithContext(std::move(sf_status_), ::absl::StrCat(__VA_ARGS__)); \
  } while (0)

// ASSIGN_OR_RETURN(auto x, F()) : declares x from a StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  SF_ASSIGN_OR_RETURN_IMPL(SF_CONCAT(sf_statusor_, __LINE__), lhs, expr, "")
// The same, with "<StrCat(context...)>: " before the message.
#define ASSIGN_OR_RETURN_CTX(lhs, expr, ...)                              \
  SF_ASSIGN_OR_RETURN_IMPL(SF_CONCAT(sf_statusor_, __LINE__), lhs, expr, \
                           ::absl::StrCat(__VA_ARGS__))
#define SF_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr, context)                 \
  auto tmp = (expr);                                                      \
  if (!tmp.ok()) return ::stallfree::WithContext(tmp.status(), context); \
  lhs = std::move(tmp).value()

namespace stallfree {

// s with "<context>: " before its message, the same code. OK, or an empty context, leaves s as
// it is. (No status in this tree carries payloads; they are not copied: that would link absl's
// Cord into every user.)
inline absl::Status WithContext(absl::Status s, absl::string_view context) {
  if (s.ok() || context.empty()) return s;
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

// A status for a failed system call: names the call, the object and errno, and logs it at ERROR
// level (NCCL habit: every system-call failure is logged). The code follows errno, so that
// callers decide by code:
//   ENOENT              NOT_FOUND (a file or directory is missing; where that means a
//                       misconfiguration, the caller returns its own FAILED_PRECONDITION)
//   ECONNREFUSED, ECONNRESET, EPIPE, ENOTCONN
//                       UNAVAILABLE (nobody listens, or the connection broke: the peer process
//                       is gone)
//   ENOMEM, EAGAIN      RESOURCE_EXHAUSTED
//   EACCES, EPERM       PERMISSION_DENIED
//   anything else       INTERNAL
absl::Status ErrnoStatus(const std::string& call, const std::string& object, int err = errno);

namespace status_internal {
inline const absl::Status& StatusOf(const absl::Status& s) { return s; }
inline absl::Status StatusOf(absl::Status&& s) { return std::move(s); }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}
template <typename T>
absl::Status StatusOf(absl::StatusOr<T>&& s) {
  return std::move(s).status();
}
}  // namespace status_internal

}  // namespace stallfree
