// OpKindName and CommOptions::FromEnvironment.
#include "parallel/communicator.h"

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace stallfree {
namespace parallel {

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kReduce:
      return "reduce";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kNumKinds:
      break;
  }
  return "unknown";
}

namespace {

// Reads an integer environment variable in [lo, hi]. Returns false in *present if unset.
absl::Status ReadIntEnv(const char* name, int64_t lo, int64_t hi, bool* present, int64_t* out) {
  const char* text = std::getenv(name);
  *present = text != nullptr && *text != '\0';
  if (!*present) return absl::OkStatus();
  errno = 0;
  char* end = nullptr;
  long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0') {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", text, "' is not an integer"));
  }
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, "=", value,
                                                   " is out of range [", lo, ", ", hi, "]"));
  }
  *out = value;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CommOptions> CommOptions::FromEnvironment() {
  CommOptions options;
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  bool has_rank = false, has_size = false, present = false;
  int64_t rank = 0, size = 1, value = 0;
  RETURN_IF_ERROR(ReadIntEnv("RANK", 0, kIntMax, &has_rank, &rank));
  RETURN_IF_ERROR(ReadIntEnv("WORLD_SIZE", 1, kIntMax, &has_size, &size));
  // A missing WORLD_SIZE means 1 and a missing RANK means 0, so an unlaunched process is a
  // single rank; a group of several ranks without RANK is an error.
  if (has_size && size > 1 && !has_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable WORLD_SIZE=", size, " but RANK is not set"));
  }
  if (rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable RANK=", rank,
                                                   " must be < WORLD_SIZE=", size));
  }
  options.rank = static_cast<int>(rank);
  options.size = static_cast<int>(size);
  RETURN_IF_ERROR(ReadIntEnv("LOCAL_RANK", 0, kIntMax, &present, &value));
  options.local_rank = present ? static_cast<int>(value) : options.rank;
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') {
    options.master_addr = addr;
  }
  RETURN_IF_ERROR(ReadIntEnv("MASTER_PORT", 1, 65535, &present, &value));
  if (present) options.master_port = static_cast<int>(value);
  if (const char* dir = std::getenv("STALLFREE_STORE_DIR"); dir != nullptr) {
    options.store_dir = dir;
  }
  RETURN_IF_ERROR(ReadIntEnv("STALLFREE_COMM_TIMEOUT_MS", 1,
                             std::numeric_limits<int64_t>::max() / 2, &present, &value));
  if (present) options.timeout = std::chrono::milliseconds(value);
  return options;
}

}  // namespace parallel
}  // namespace stallfree
