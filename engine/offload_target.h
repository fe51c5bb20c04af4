// stallfree::OffloadTarget: what the ZenFlow engine needs of the place its offloaded optimizer
// state lives, in the engine's own types (no gRPC, no protobuf). The RPC client implements it
// over a stallfreed session (client/session_target.h); the engine never sees the transport.
//
// The model is a stallfreed session (offload.proto has the full contract of each call): a set
// of registered parameters, each with an fp32 master, m and v held by the target; shared memory
// the engine reads and writes directly: two gradient slots (what Push and UpdateWithPush read),
// one or two parameter slots (what an Update writes) and a staging area (loads, column
// handovers); and asynchronous Updates, numbered by step, that the engine waits for.
//
// Errors are absl::Status with the daemon's canonical codes; UNAVAILABLE means the target went
// away (the daemon exited or the connection broke: client/client.h says which codes mean what).
// Thread safety: the engine calls from its caller's thread and its copy thread; the methods
// must be thread safe (the shared-memory accessors are plain address arithmetic).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace stallfree {

class OffloadTarget {
 public:
  virtual ~OffloadTarget() = default;

  // A parameter as the target holds it: the fp32 master of `shape`, whose gradient arrives as
  // grad_dtype.
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
    DType grad_dtype = DType::kFp32;
  };
  // Registers the parameters and maps the shared memory. Call once, on a fresh target.
  // param_dtype: what Updates write to the parameter slots; param_slots: 1 or 2.
  virtual absl::Status Register(const std::vector<Param>& params, DType param_dtype,
                                uint32_t param_slots) = 0;

  // The layout, once registered (by Register, or by whoever registered the session before).
  virtual size_t registered_params() const = 0;  // 0: nothing registered yet
  virtual DType param_dtype() const = 0;
  virtual uint32_t param_slots() const = 0;
  // The registered size of parameter `name`; NotFound if there is none.
  virtual absl::StatusOr<int64_t> ParamNumel(const std::string& name) const = 0;
  // Where parameter `name`'s gradient goes in gradient slot `slot` (0 or 1), in its grad_dtype.
  virtual void* GradSlot(uint32_t slot, const std::string& name) const = 0;
  // Parameter `name` in parameter slot `slot` as the last Update into that slot with out dtype
  // `out` wrote it; null for a slot the target does not have, and for fp32 in bf16 slots.
  virtual const void* ParamSlot(uint32_t slot, const std::string& name, DType out) const = 0;
  // The staging area: staging_floats() floats.
  virtual float* Staging() const = 0;
  virtual uint64_t staging_floats() const = 0;

  // Initial fp32 values the caller wrote into Staging(): `count` elements of `param` from
  // `first_element`, read at `staging_offset` bytes into the staging area.
  struct LoadRange {
    std::string param;
    uint64_t first_element = 0, count = 0;
    uint64_t staging_offset = 0;
  };
  virtual absl::Status LoadParams(const std::vector<LoadRange>& ranges) = 0;

  // Accumulates every parameter's gradient in gradient slot `slot`, times `scale`.
  virtual absl::Status Push(int64_t step, uint32_t slot, float scale) = 0;

  // AdamW's hyper-parameters of one Update (decoupled weight decay).
  struct AdamW {
    double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
    // The parameters go out predicted one Update ahead, 2 p_new - p_old (offload.proto,
    // UpdateRequest.predict); the state is AdamW's as always.
    bool predict = false;
  };
  // Starts the Update of version `step` with per-column step counts, the gradients of
  // `grad_slot` pushed (times push_scale) as part of it, and returns once accepted. Its
  // parameters go to `param_slot` in `out`. skip_params: parameters it leaves unchanged. The
  // caller must not write grad_slot until WaitUpdate(step) returns.
  virtual absl::Status UpdateWithPush(int64_t step, const AdamW& hyper, uint32_t param_slot,
                                      DType out, uint32_t grad_slot, float push_scale,
                                      const std::vector<std::string>& skip_params) = 0;
  // Waits until the parameters of version `min_version` (or newer) are in their slot.
  virtual absl::Status WaitUpdate(int64_t min_version) = 0;
  // The newest Update a WaitUpdate has returned: its version and the seconds the daemon's
  // AdamW took on it ({0, 0} before any, or where the target does not know). Any thread.
  struct UpdateSeen {
    int64_t version = 0;
    double seconds = 0;
  };
  virtual UpdateSeen LastUpdate() const { return {}; }

  // Hands columns over in the middle of a round (offload.proto, MigrateColumnsRequest.handover):
  // each move's incoming [rows, n] values, m and v are in Staging(), each move's four blocks
  // after the previous move's; the outgoing columns' values, m, v and accumulated gradient come
  // back in those four blocks.
  struct ColumnMove {
    std::string param;
    std::vector<int64_t> columns, steps;
  };
  struct HandOver {
    std::vector<std::vector<int64_t>> steps;  // per move, the outgoing columns' step counts
    int64_t pushes = 0;  // pushes in the handed-over accumulator (0: the gradients are zero)
  };
  virtual absl::StatusOr<HandOver> HandOverColumns(const std::vector<ColumnMove>& moves) = 0;

  // The target's state as checkpoint `tag`, its restoration into this (registered) target (the
  // parameter slots then hold the restored values in `out`), and the checkpoint's removal
  // (NotFound if there is none).
  virtual absl::Status Checkpoint(const std::string& tag) = 0;
  virtual absl::Status Restore(const std::string& tag, DType out) = 0;
  virtual absl::Status DeleteCheckpoint(const std::string& tag) = 0;
  // A checkpoint's bytes (deleted once read, with delete_after), and the inverse: `bytes` (as
  // ReadCheckpoint gave them) stored as `tag` for a later Restore.
  virtual absl::StatusOr<std::string> ReadCheckpoint(const std::string& tag,
                                                     bool delete_after) = 0;
  virtual absl::Status WriteCheckpoint(const std::string& tag, const std::string& bytes) = 0;
  // The target's state as the bytes a checkpoint of it would hold, and their restoration into
  // this (registered) target as Restore would (the parameter slots then hold the restored
  // values in `out`), with no checkpoint file anywhere (offload.proto: ExportState,
  // ImportState). An import that fails once it began to change the state leaves a target that
  // held no state yet as fresh as it was (see ImportStateRequest).
  virtual absl::StatusOr<std::string> ExportState() = 0;
  virtual absl::Status ImportState(const std::string& bytes, DType out) = 0;
};

}  // namespace stallfree
