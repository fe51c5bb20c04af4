#include "trainer/resume.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/repartition.h"

namespace stallfree {
namespace trainer {
namespace {

absl::Status NprocError(const std::string& tag, int64_t written, int64_t D) {
  return absl::FailedPreconditionError(
      absl::StrCat("resume: checkpoint '", tag, "' was written by a run with --nproc ", written,
                   " (TSP ranks per replica), and this run has --nproc ", D,
                   "; the TSP size must stay the "
                   "same at a resume (only --dp may change): resume with --nproc ",
                   written));
}

absl::Status DtypeError(const TrainOptions& o, const RankState& written, const std::string& file) {
  const std::string& tag = o.resume;
  return absl::FailedPreconditionError(
      absl::StrCat("resume: checkpoint '", tag, "' (", file, ") holds a --model_dtype ",
                   DTypeName(written.dtype), " model, and this run has --model_dtype ",
                   DTypeName(o.model_dtype),
                   "; a resume keeps the model's storage: resume with "
                   "--model_dtype ",
                   DTypeName(written.dtype), " (a new run with --init_from ", o.out_dir,
                   "/checkpoints/", tag, " --model_dtype ", DTypeName(o.model_dtype),
                   " starts from its weights with a fresh optimizer)"));
}

absl::Status AnotherModelError(const std::string& tag) {
  return absl::FailedPreconditionError(
      absl::StrCat("resume: checkpoint '", tag,
                   "' was written by a run with another model, batch, "
                   "rank count or mode"));
}

// The file of the checkpoint's replica 0 at this TSP position p (global rank p, which every run
// of D TSP ranks has), checked against this run: the TSP size, the model dtype, the model.
absl::StatusOr<RankState> ReadWriterHead(const TrainOptions& o, const std::vector<int64_t>& key,
                                         size_t tensors) {
  const std::string& tag = o.resume;
  const int p = static_cast<int>(key[kKeyTspRank]);
  const int64_t D = key[kKeyD];
  absl::StatusOr<RankState> head = DecodeState(RankFile(o.out_dir, tag, p));
  if (absl::IsNotFound(head.status()) && p > 0) {
    absl::StatusOr<RankState> zero = DecodeState(RankFile(o.out_dir, tag, 0));
    if (zero.ok() && zero->shape.size() >= kKeyFields && zero->shape[kKeyD] != D)
      return NprocError(tag, zero->shape[kKeyD], D);
  }
  RETURN_IF_ERROR(head.status());
  if (head->shape.size() < kKeyFields)
    return absl::DataLossError(
        absl::StrCat("resume: ", RankFile(o.out_dir, tag, p), " has a malformed header"));
  if (head->shape[kKeyD] != D) return NprocError(tag, head->shape[kKeyD], D);
  if (head->dtype != o.model_dtype) return DtypeError(o, *head, RankFile(o.out_dir, tag, p));
  if (!SameModel(head->shape, key) || head->tensors.size() != tensors)
    return AnotherModelError(tag);
  return head;
}

absl::Status CheckGlobalBatch(const std::string& tag, int64_t old_n, int64_t old_b, int N,
                              int64_t B) {
  if (old_n * old_b == N * B) return absl::OkStatus();
  const int64_t global = old_n * old_b;
  return absl::FailedPreconditionError(absl::StrCat(
      "resume: checkpoint '", tag, "' was written by a run with --dp ", old_n, " --batch ", old_b,
      " (a global batch of ", global, " sequences), and this run has --dp ", N, " --batch ", B,
      " (", N * B, "); a resume keeps the global batch: ",
      global % N == 0 ? absl::StrCat("pass --batch ", global / N)
                      : absl::StrCat("no --batch gives ", global, " sequences over ", N,
                                     " replicas; choose a --dp that divides ", global)));
}

// The same --dp: this rank's own file (`head` when it is this rank's) and daemon tag.
absl::StatusOr<ResumeState> ResumeSameDp(const TrainOptions& o, const std::vector<int64_t>& key,
                                         int rank, RankState head, size_t tensors) {
  const std::string& tag = o.resume;
  ResumeState out;
  out.written_dp = WrittenDp(head);
  if (rank == key[kKeyTspRank]) {
    out.st = std::move(head);
  } else {
    ASSIGN_OR_RETURN(out.st, DecodeState(RankFile(o.out_dir, tag, rank)));
    if (out.st.dtype != o.model_dtype) return DtypeError(o, out.st, RankFile(o.out_dir, tag, rank));
  }
  if (out.st.shape != key || out.st.tensors.size() != tensors) return AnotherModelError(tag);
  out.daemon_tag = absl::StrCat(tag, ".r", rank);
  return out;
}

// Old replica j's state at this TSP position (global rank `from`): its engine's from its file
// (checked against `head`, replica 0's) and its daemon checkpoint's bytes (through `session`;
// a missing one is added to *missing: nothing was offloaded yet, or it is lost).
absl::Status ReadSource(const TrainOptions& o, const RankState& head, int j, int from,
                        Session* session, PartitionedState* state,
                        std::vector<std::string>* missing) {
  const std::string& tag = o.resume;
  const int p = static_cast<int>(head.shape[kKeyTspRank]);
  const int64_t old_n = WrittenDp(head), old_b = head.shape[kKeyBatch];
  if (j == 0) {
    state->engine = head.engine;
  } else {
    const std::string file = RankFile(o.out_dir, tag, from);
    ASSIGN_OR_RETURN(RankState sj, DecodeState(file));
    if (sj.dtype != o.model_dtype) return DtypeError(o, sj, file);
    const bool same = SameModel(sj.shape, head.shape) && WrittenDp(sj) == old_n &&
                      sj.shape.size() > kDpKey + 1 && sj.shape[kDpKey + 1] == j &&
                      sj.shape[kKeyBatch] == old_b;
    if (!same)
      return absl::FailedPreconditionError(absl::StrCat("resume: ", file, " is not replica ", j,
                                                        " of the --dp ", old_n, " run that wrote ",
                                                        RankFile(o.out_dir, tag, p)));
    if (sj.step != head.step || sj.data_position != head.data_position)
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: the files of checkpoint '", tag, "' disagree: ", file, " is at step ", sj.step,
          ", ", RankFile(o.out_dir, tag, p), " at step ", head.step));
    state->engine = std::move(sj.engine);
  }
  if (session == nullptr) return absl::OkStatus();
  const std::string daemon_tag = absl::StrCat(tag, ".r", from);
  absl::StatusOr<std::string> bytes =
      session->ReadCheckpointBytes(daemon_tag, /*delete_after=*/false);
  if (bytes.ok()) {
    state->daemon = *std::move(bytes);
  } else if (absl::IsNotFound(bytes.status())) {
    missing->push_back(daemon_tag);
  } else {
    return WithContext(bytes.status(),
                       absl::StrCat("resume: reading the daemon's checkpoint ", daemon_tag));
  }
  return absl::OkStatus();
}

// Another --dp: this replica's blocks from the old replicas' (engine/repartition.h).
absl::StatusOr<ResumeState> ResumeOtherDp(const TrainOptions& o, const std::vector<int64_t>& key,
                                          int N, int replica, int rank, RankState head,
                                          const std::vector<Tensor>& tensors, Session* session) {
  const std::string& tag = o.resume;
  const int p = static_cast<int>(key[kKeyTspRank]);
  const int64_t D = key[kKeyD], old_n = WrittenDp(head);
  ResumeState out;
  out.written_dp = old_n;
  std::vector<WholeParam> whole;
  for (const Tensor& t : tensors) whole.push_back({t.name, t.shape});
  const std::vector<int> sources = SourceRanks(whole, static_cast<int>(old_n), N, replica);
  std::vector<PartitionedState> states(old_n);
  std::vector<const PartitionedState*> old(old_n, nullptr);
  for (int j : sources) {
    RETURN_IF_ERROR(
        ReadSource(o, head, j, static_cast<int>(j * D + p), session, &states[j], &out.missing));
    old[j] = &states[j];
  }
  absl::StatusOr<PartitionedState> mine = Repartition(whole, old, N, replica);
  if (!mine.ok())
    return WithContext(mine.status(),
                       absl::StrCat("resume: re-partitioning checkpoint '", tag, "' (--dp ", old_n,
                                    ", rank j = its replica j, global rank j x ", D, " + ", p,
                                    ") for replica ", replica, " of --dp ", N));
  states.clear();
  out.st = std::move(head);
  out.st.shape = key;
  out.st.engine = std::move(mine->engine);
  out.repartitioned = true;
  out.daemon = std::move(mine->daemon);
  return out;
}

}  // namespace

absl::StatusOr<ResumeState> ReadResume(const TrainOptions& o, const std::vector<int64_t>& key,
                                       int N, int replica, int rank,
                                       const std::vector<Tensor>& tensors, Session* session) {
  ASSIGN_OR_RETURN(RankState head, ReadWriterHead(o, key, tensors.size()));
  RETURN_IF_ERROR(
      CheckGlobalBatch(o.resume, WrittenDp(head), head.shape[kKeyBatch], N, key[kKeyBatch]));
  if (WrittenDp(head) == N) return ResumeSameDp(o, key, rank, std::move(head), tensors.size());
  return ResumeOtherDp(o, key, N, replica, rank, std::move(head), tensors, session);
}

}  // namespace trainer
}  // namespace stallfree
