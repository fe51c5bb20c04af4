// The trainer's checkpoint files: one per rank, <out_dir>/checkpoints/<tag>.rank<r>.trainer
// (r: the global rank), beside the daemon's state of the same tag (<tag>.r<r>, server/
// checkpoint.h). A file holds the rank's whole tensors (its TSP shard, every element), its
// engine's state, the data position and the step; the shape key says which run and rank wrote
// it, so that a resume can refuse another model, rank count, batch or mode.
//
// Format (every integer int64 little-endian). Version 1 (fp32 models only): magic "SFTRAIN1",
// step, data position, the shape key (its length, then its fields), the tensors (their count,
// then each its element count and its fp32 values), the engine's state (its length, then its
// bytes), a Checksum64 of everything before it. Version 2 ("SFTRAIN2") adds the model dtype
// after the shape key (0: fp32, 1: bf16) and stores each tensor in it (bf16: 2 bytes an
// element). Both are read; version 2 is written. Writes are atomic (common/atomic_file.h).
//
// Thread safety: the functions are; a RankState is a plain value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "engine/zenflow.h"

namespace stallfree {
namespace trainer {

// One rank's checkpoint, as written and read.
struct RankState {
  int64_t step = 0;
  int64_t data_position = 0;
  std::vector<int64_t> shape;        // the shape key (below)
  DType dtype = DType::kFp32;  // the model's: how `tensors` hold the values
  // Each tensor's values, little-endian, numel x (4 or 2) bytes (fp32 or bf16 bits).
  std::vector<std::string> tensors;
  std::string engine;

  size_t elem_size() const { return dtype == DType::kBf16 ? 2 : 4; }
  int64_t numel(size_t i) const { return static_cast<int64_t>(tensors[i].size() / elem_size()); }
};

// The shape key's fields: the TSP rank and size, layers, C, H, FF, vocab, T, the per-replica
// batch, the mode, tied head, learned positions; then, written by a run with --dp N > 1, N and
// the replica (a run with one replica writes the key of the runs before --dp, whose checkpoints
// it resumes).
constexpr size_t kKeyTspRank = 0, kKeyD = 1, kKeyBatch = 8, kKeyMode = 9, kKeyFields = 12,
                 kDpKey = 12;

// The --dp of the run that wrote `st` (1 for a key without the data-parallel fields).
int64_t WrittenDp(const RankState& st);
// Whether two keys describe the same model, TSP rank and size, and mode (the batch and the
// data-parallel fields aside).
bool SameModel(const std::vector<int64_t>& a, const std::vector<int64_t>& b);

// The file's bytes (version 2), its checksum last.
std::string EncodeState(const RankState& s);
// Reads and verifies `path`: NotFound if it is missing, DataLoss (naming it) if it is not a
// trainer checkpoint, is truncated or corrupt (checksum) or malformed.
absl::StatusOr<RankState> DecodeState(const std::string& path);
// Tensor i of a file as fp32 values (bf16 ones widened, exactly).
std::vector<float> FileValuesAsFloat(const RankState& s, size_t i);

// <out_dir>/checkpoints/<tag>.rank<rank>.trainer
std::string RankFile(const std::string& out_dir, const std::string& tag, int rank);
// Writes `s` as RankFile(out_dir, tag, rank), atomically and durably.
absl::Status WriteRankFile(const std::string& out_dir, const std::string& tag, int rank,
                           const RankState& s);

// The steps of run `run_name`'s checkpoints that `rank` holds in out_dir
// (<run_name>-step<N>.rank<rank>.trainer), oldest first.
std::vector<int64_t> RunCheckpointSteps(const std::string& out_dir, const std::string& run_name,
                                        int rank);

// Removes this rank's checkpoints of run `run_name` beyond the newest `keep` (0: keeps all): its
// trainer file and the daemon's state of the same tag (through `engine`). A failure is logged,
// not returned: training goes on with the files left behind.
void PruneCheckpoints(const std::string& out_dir, const std::string& run_name, int64_t keep,
                      int rank, ZenFlowEngine* engine);

}  // namespace trainer
}  // namespace stallfree
