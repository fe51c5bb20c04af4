// The checks of stallfreed's requests that need nothing but the request and the session's
// layout. Each turns a request into the plan of its work (offload_session.h), or returns the
// error naming the first bad field: InvalidArgument, NotFound for an unknown parameter,
// FailedPrecondition for a dtype other than the registered one. None touches memory or session
// state; SessionManager calls them after its Lookup and before the session's own checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/offload_session.h"
#include "server/session_record.h"
#include "stallfree/v1/offload.pb.h"

namespace stallfree {

// Elements between the starts of a session's state arrays (master, m, v and the accumulator,
// one block) for `elems` elements each: the least count >= elems that is 272 more than a multiple
// of 1024 (at most 1023 elements of padding per array). Element i of the four arrays then lies
// 1088 bytes further into a page from one array to the next: different cache sets, no 4 KiB
// aliasing. Placed exactly elems apart, with elems a multiple of a large power of two, the
// update's streams share sets and alias: bench/optimizer_bench's "session state placement", 2^26
// elements, alternated runs: 1.04 Gelem/s packed, 1.64 staggered.
uint64_t StateStride(uint64_t elems);

// The parameters of a RegisterParams request, laid out (offload_session.h, SessionLayout), for a
// session record of `record_format` (session_record.h: a state of format 2, adopted, keeps the
// work journal it was laid out with, whose plan has no room for a handover's).
absl::StatusOr<SessionLayout> LayOutParams(const v1::RegisterParamsRequest& request,
                                           uint32_t record_format = kRecordFormat);
// A layout's parameters as its session record names them.
std::vector<RecordParam> RecordParamsOf(const SessionLayout& layout);

// The copies of a LoadParams request: its ranges, or the parameters it names (none named: all)
// whole from their staging offsets.
absl::StatusOr<std::vector<LoadJob>> PlanLoad(const v1::LoadParamsRequest& request,
                                              const SessionLayout& layout);

// The dtype an Update or Restore writes to the parameter slots, for a requested one
// (UNSPECIFIED: the registered one); FailedPrecondition for FP32 into BF16 slots. `field` names
// the request's field in the messages.
absl::StatusOr<v1::DType> OutputDType(v1::DType requested, const SessionLayout& layout,
                                      const std::string& field);

// A push from a gradient slot: its ranges (none: the whole slot) as accumulator jobs.
absl::StatusOr<PushPlan> PlanPush(const v1::PushGradientsRequest& request,
                                  const SessionLayout& layout);
// A push of the request's own bytes. The jobs point into request.data().
absl::StatusOr<PushPlan> PlanPush(const v1::PushGradientsInlineRequest& request,
                                  const SessionLayout& layout);

// An Update's hyper-parameters, slots, dtype and options (session_id: for the messages).
absl::StatusOr<UpdatePlan> PlanUpdate(const v1::UpdateRequest& request,
                                      const SessionLayout& layout, uint64_t session_id);

// A MigrateColumns request's parameter, columns and step counts, and its further parameters
// (request.more), in order. InvalidArgument unless request.handover (the only migration).
absl::StatusOr<std::vector<MigratePlan>> PlanMigrate(const v1::MigrateColumnsRequest& request,
                                                     const SessionLayout& layout);

// A WriteCheckpoint chunk: it fits the staging area and the file's total_bytes.
absl::Status CheckChunk(const v1::WriteCheckpointRequest& request, const SessionLayout& layout);
// An ImportState chunk: the same, and it moves at least one byte until the state is whole.
absl::Status CheckChunk(const v1::ImportStateRequest& request, const SessionLayout& layout);

}  // namespace stallfree
