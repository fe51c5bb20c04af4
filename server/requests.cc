#include "server/requests.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/bounds.h"
#include "common/status.h"

namespace stallfree {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kElemAlign = 16;  // 64 bytes of fp32.
constexpr int64_t kMaxNumel = int64_t{1} << 40;
// The staging area (offload.proto, RegionLayout.staging_bytes): one fp32 per this many state
// elements, ...
constexpr uint64_t kStagingShare = 32;
// ... but at least the whole session's fp32 values up to this many (64 KiB: a small session
// loads in one call, every parameter at its staging_offset) ...
constexpr uint64_t kStagingWholeElems = 16384;
// ... and at least the 4 blocks of one column of the tallest parameter (a handover of one
// column always fits).
constexpr uint64_t kHandoverBlocks = 4;

}  // namespace

std::vector<RecordParam> RecordParamsOf(const SessionLayout& layout) {
  std::vector<RecordParam> out;
  for (const ParamLayout& p : layout.params)
    out.push_back({p.name, p.shape, static_cast<uint32_t>(p.grad_dtype)});
  return out;
}

uint64_t StateStride(uint64_t elems) { return elems + (1024 + 272 - elems % 1024) % 1024; }

absl::StatusOr<SessionLayout> LayOutParams(const v1::RegisterParamsRequest& req,
                                           uint32_t record_format) {
  if (req.params_size() == 0) return absl::InvalidArgumentError("params: empty");
  if (req.param_dtype() != v1::DTYPE_UNSPECIFIED && req.param_dtype() != v1::DTYPE_FP32 &&
      req.param_dtype() != v1::DTYPE_BF16)
    return absl::InvalidArgumentError("param_dtype: must be FP32 or BF16 (or unspecified: FP32)");
  if (req.param_slots() > 2)
    return absl::InvalidArgumentError(
        absl::StrCat("param_slots: ", req.param_slots(), " is not 1 or 2 (or 0: 2)"));
  const v1::DType param_dtype =
      req.param_dtype() == v1::DTYPE_BF16 ? v1::DTYPE_BF16 : v1::DTYPE_FP32;
  // A request without param_slots (a client from before the field) gets the layout it was
  // written for: two parameter slots and a staging area that holds all of its fp32 values.
  const bool legacy = req.param_slots() == 0;
  const uint32_t param_slots = legacy ? 2 : req.param_slots();
  SessionLayout out;
  uint64_t elems = 0, grad_bytes = 0, max_rows = 1;
  for (int i = 0; i < req.params_size(); ++i) {
    const v1::ParamSpec& p = req.params(i);
    const std::string field = absl::StrCat("params[", i, "]");
    if (p.name().empty() || p.name().size() > 1024)
      return absl::InvalidArgumentError(field + ".name: empty or longer than 1024 bytes");
    if (out.index.count(p.name()))
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".name: duplicate parameter '", p.name(), "'"));
    if (p.shape_size() == 0 || p.shape_size() > 8)
      return absl::InvalidArgumentError(field + ".shape: needs 1 to 8 dimensions");
    // The leading dimension may be 0: a data-parallel rank's empty share of a parameter
    // (FSDP2 gives the last ranks none of a parameter with fewer rows than ranks), registered
    // so that the session's parameters are the same list on every rank; it holds nothing.
    int64_t numel = 1;
    for (int d = 0; d < p.shape_size(); ++d) {
      const int64_t least = d == 0 ? 0 : 1;
      if (p.shape(d) < least || p.shape(d) > kMaxNumel ||
          (p.shape(d) > 0 && numel > kMaxNumel / p.shape(d)))
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".shape[", d, "]: ", p.shape(d), " is not a dimension >= ", least,
            ", or the parameter exceeds 2^40 elements"));
      numel *= p.shape(d);
    }
    if (p.grad_dtype() != v1::DTYPE_FP32 && p.grad_dtype() != v1::DTYPE_BF16)
      return absl::InvalidArgumentError(field + ".grad_dtype: must be FP32 or BF16");
    ParamLayout info;
    info.name = p.name();
    info.shape.assign(p.shape().begin(), p.shape().end());
    info.numel = numel;
    info.grad_dtype = p.grad_dtype();
    info.elem_offset = elems;
    info.grad_offset = grad_bytes;
    info.cols = p.shape(p.shape_size() - 1);
    info.rows = info.cols > 0 ? numel / info.cols : 0;
    max_rows = std::max<uint64_t>(max_rows, static_cast<uint64_t>(info.rows));
    uint64_t padded, padded_bytes;
    if (!AlignUp(static_cast<uint64_t>(numel), kElemAlign, &padded) ||
        !AddOverflow(elems, padded, &elems) ||
        !MulOverflow(padded, info.grad_element_bytes(), &padded_bytes) ||
        !AddOverflow(grad_bytes, padded_bytes, &grad_bytes) || elems > (uint64_t{1} << 44))
      return absl::InvalidArgumentError("params: total size overflows");
    out.index[info.name] = out.params.size();
    out.params.push_back(std::move(info));
  }
  // Every size below is at most 4 * elems (< 2^46) or 16 * max_rows (< 2^45) plus a page: no
  // overflow.
  const uint64_t param_bytes = param_dtype == v1::DTYPE_BF16 ? 2 : 4;
  const uint64_t staging_floats =
      legacy ? elems
             : std::max({(elems + kStagingShare - 1) / kStagingShare, kHandoverBlocks * max_rows,
                         std::min(elems, kStagingWholeElems)});
  uint64_t gslot, pslot, staging;
  AlignUp(grad_bytes, kPage, &gslot);
  AlignUp(elems * param_bytes, kPage, &pslot);
  AlignUp(staging_floats * 4, kPage, &staging);
  v1::RegionLayout& layout = out.region;
  layout.set_region_bytes(2 * gslot + param_slots * pslot + staging);
  layout.set_grad_slot_offset(0);
  layout.set_grad_slot_bytes(gslot);
  layout.set_param_slot_offset(2 * gslot);
  layout.set_param_slot_bytes(pslot);
  layout.set_param_slots(param_slots);
  layout.set_param_dtype(param_dtype);
  layout.set_staging_offset(2 * gslot + param_slots * pslot);
  layout.set_staging_bytes(staging);
  for (const ParamLayout& p : out.params) {
    v1::ParamLayout* pl = layout.add_params();
    pl->set_name(p.name);
    pl->set_numel(p.numel);
    pl->set_grad_offset(p.grad_offset);
    pl->set_param_offset_fp32(p.elem_offset * 4);
    pl->set_param_offset_bf16(p.elem_offset * 2);
    pl->set_staging_offset(p.elem_offset * 4);
  }
  out.total_elems = elems;
  out.state_stride = StateStride(elems);
  AlignUp(RecordBytes(RecordParamsOf(out)), kPage, &out.arrays_offset);
  AlignUp(out.arrays_offset + 4 * out.state_stride * 4, kPage, &out.journal_offset);
  uint64_t columns = 0;  // (none for a journal of before handovers were kept)
  if (record_format >= kRecordFormat)
    for (const ParamLayout& p : out.params) columns += static_cast<uint64_t>(p.cols);
  out.journal = JournalGeometryFor(elems, out.params.size(), columns);
  out.record_format = record_format;
  out.state_bytes = out.journal_offset + out.journal.bytes;
  out.requested_param_dtype = req.param_dtype();
  out.requested_param_slots = req.param_slots();
  return out;
}

absl::StatusOr<std::vector<LoadJob>> PlanLoad(const v1::LoadParamsRequest& req,
                                              const SessionLayout& layout) {
  const uint64_t staging_floats = layout.region.staging_bytes() / 4;
  std::vector<LoadJob> jobs;
  if (req.ranges_size() > 0) {
    if (req.names_size() > 0)
      return absl::InvalidArgumentError("names: not with ranges (a range names its parameter)");
    for (int i = 0; i < req.ranges_size(); ++i) {
      const v1::LoadRange& r = req.ranges(i);
      const std::string field = absl::StrCat("ranges[", i, "]");
      const int64_t p = layout.Find(r.param());
      if (p < 0)
        return absl::NotFoundError(absl::StrCat(field, ".param: no parameter '", r.param(), "'"));
      const ParamLayout& pl = layout.params[p];
      absl::Status st = CheckRange(r.first_element(), r.count(), static_cast<uint64_t>(pl.numel),
                                   field + ".first_element/count");
      if (!st.ok())
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".first_element/count: elements [", r.first_element(), ", +", r.count(),
            ") are outside parameter '", pl.name, "' of ", pl.numel, " elements"));
      if (r.staging_offset() % 4 != 0)
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".staging_offset: ", r.staging_offset(), " is not a multiple of 4"));
      st = CheckRange(r.staging_offset() / 4, r.count(), staging_floats,
                      field + ".staging_offset/count");
      if (!st.ok())
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".staging_offset/count: ", r.count(), " fp32 values at byte ",
            r.staging_offset(), " exceed the staging area of ", layout.region.staging_bytes(),
            " bytes; load in smaller ranges"));
      jobs.push_back({static_cast<size_t>(p), r.first_element(), r.count(),
                      r.staging_offset() / 4});
    }
    return jobs;
  }
  std::vector<size_t> which;
  if (req.names_size() == 0)
    for (size_t i = 0; i < layout.params.size(); ++i) which.push_back(i);
  for (int i = 0; i < req.names_size(); ++i) {
    const int64_t p = layout.Find(req.names(i));
    if (p < 0)
      return absl::NotFoundError(
          absl::StrCat("names[", i, "]: no parameter '", req.names(i), "'"));
    which.push_back(static_cast<size_t>(p));
  }
  for (size_t i : which) {
    const ParamLayout& p = layout.params[i];
    // Whole, from its staging_offset (the element offset): only where it fits.
    if (p.elem_offset + static_cast<uint64_t>(p.numel) > staging_floats)
      return absl::InvalidArgumentError(absl::StrCat(
          "names: parameter '", p.name, "' (", p.numel, " elements at staging byte ",
          p.elem_offset * 4, ") does not fit in the staging area of ",
          layout.region.staging_bytes(), " bytes; load it by ranges (LoadParamsRequest.ranges)"));
    jobs.push_back({i, 0, static_cast<uint64_t>(p.numel), p.elem_offset});
  }
  return jobs;
}

absl::StatusOr<PushPlan> PlanPush(const v1::PushGradientsRequest& req,
                                  const SessionLayout& layout) {
  if (req.slot() > 1)
    return absl::InvalidArgumentError(absl::StrCat("slot: ", req.slot(), " is not 0 or 1"));
  const uint64_t slot_bytes = layout.region.grad_slot_bytes();
  const uint64_t slot = layout.region.grad_slot_offset() + req.slot() * slot_bytes;
  if (!std::isfinite(req.scale()))
    return absl::InvalidArgumentError("scale: must be finite (0 means 1)");
  PushPlan plan;
  plan.whole = req.ranges_size() == 0;
  plan.scale = req.scale() == 0.0f ? 1.0f : req.scale();
  if (plan.whole) {
    for (const ParamLayout& p : layout.params) {
      plan.jobs.push_back({p.elem_offset, nullptr, slot + p.grad_offset, p.grad_type(), p.numel});
      plan.bytes += p.numel * p.grad_element_bytes();
    }
  }
  for (int i = 0; i < req.ranges_size(); ++i) {
    const v1::GradRange& r = req.ranges(i);
    const std::string field = absl::StrCat("ranges[", i, "]");
    const int64_t which = layout.Find(r.param());
    if (which < 0)
      return absl::NotFoundError(absl::StrCat(field, ".param: no parameter '", r.param(), "'"));
    const ParamLayout& p = layout.params[which];
    if (r.dtype() != v1::DTYPE_UNSPECIFIED && r.dtype() != p.grad_dtype)
      return absl::FailedPreconditionError(absl::StrCat(
          field, ".dtype: ", v1::DType_Name(r.dtype()), " but '", p.name, "' was registered with ",
          v1::DType_Name(p.grad_dtype)));
    const uint64_t esize = p.grad_element_bytes();
    absl::Status st = CheckRange(r.offset(), r.length(), slot_bytes, field + ".offset/length");
    if (!st.ok()) return st;
    if (r.offset() % esize != 0 || r.length() % esize != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".offset/length: not a multiple of the ", esize, "-byte element"));
    const uint64_t count = r.length() / esize;
    st = CheckRange(r.first_element(), count, static_cast<uint64_t>(p.numel),
                    field + ".first_element");
    if (!st.ok())
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".first_element: elements [", r.first_element(), ", +", count,
          ") are outside parameter '", p.name, "' of ", p.numel, " elements"));
    plan.jobs.push_back({p.elem_offset + r.first_element(), nullptr, slot + r.offset(),
                         p.grad_type(), static_cast<int64_t>(count)});
    plan.bytes += r.length();
  }
  return plan;
}

absl::StatusOr<PushPlan> PlanPush(const v1::PushGradientsInlineRequest& req,
                                  const SessionLayout& layout) {
  const int64_t which = layout.Find(req.param());
  if (which < 0)
    return absl::NotFoundError(absl::StrCat("param: no parameter '", req.param(), "'"));
  const ParamLayout& p = layout.params[which];
  const uint64_t esize = p.grad_element_bytes();
  if (req.data().size() % esize != 0 || req.data().size() / esize > static_cast<uint64_t>(p.numel))
    return absl::InvalidArgumentError(absl::StrCat(
        "data: ", req.data().size(), " bytes is not a whole number of elements within '", p.name,
        "'"));
  if (!std::isfinite(req.scale()))
    return absl::InvalidArgumentError("scale: must be finite (0 means 1)");
  PushPlan plan;
  const int64_t count = static_cast<int64_t>(req.data().size() / esize);
  plan.jobs.push_back({p.elem_offset, reinterpret_cast<const uint8_t*>(req.data().data()), 0,
                       p.grad_type(), count});
  plan.whole = layout.params.size() == 1 && count == p.numel;
  plan.scale = req.scale() == 0.0f ? 1.0f : req.scale();
  plan.bytes = req.data().size();
  return plan;
}

absl::StatusOr<v1::DType> OutputDType(v1::DType requested, const SessionLayout& layout,
                                      const std::string& field) {
  if (requested != v1::DTYPE_UNSPECIFIED && requested != v1::DTYPE_FP32 &&
      requested != v1::DTYPE_BF16)
    return absl::InvalidArgumentError(field + ": must be FP32 or BF16");
  const v1::DType slots = layout.region.param_dtype();
  if (requested == v1::DTYPE_UNSPECIFIED) return slots;
  if (requested == v1::DTYPE_FP32 && slots == v1::DTYPE_BF16)
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": FP32, but the session registered BF16 parameter slots "
        "(RegisterParamsRequest.param_dtype)"));
  return requested;
}

absl::StatusOr<UpdatePlan> PlanUpdate(const v1::UpdateRequest& req, const SessionLayout& layout,
                                      uint64_t session_id) {
  const v1::AdamWHyper& h = req.hyper();
  if (!(h.lr() >= 0.0) || !std::isfinite(h.lr()))
    return absl::InvalidArgumentError("hyper.lr: must be finite and >= 0");
  if (!(h.beta1() >= 0.0 && h.beta1() < 1.0))
    return absl::InvalidArgumentError("hyper.beta1: must be in [0, 1)");
  if (!(h.beta2() >= 0.0 && h.beta2() < 1.0))
    return absl::InvalidArgumentError("hyper.beta2: must be in [0, 1)");
  // eps = 0 is AdamW as torch.optim.AdamW allows it (a zero moment then gives 0/0, there too).
  if (!(h.eps() >= 0.0) || !std::isfinite(h.eps()))
    return absl::InvalidArgumentError("hyper.eps: must be finite and >= 0");
  if (!(h.weight_decay() >= 0.0) || !std::isfinite(h.weight_decay()))
    return absl::InvalidArgumentError("hyper.weight_decay: must be finite and >= 0");
  if (req.param_slot() >= layout.region.param_slots())
    return absl::InvalidArgumentError(absl::StrCat(
        "param_slot: ", req.param_slot(), " is not below the session's ",
        layout.region.param_slots(), " parameter slot(s)"));
  absl::StatusOr<v1::DType> out = OutputDType(req.out_dtype(), layout, "out_dtype");
  if (!out.ok()) return out.status();
  if (req.step() < 1)
    return absl::InvalidArgumentError(absl::StrCat("step: ", req.step(), " is not >= 1"));
  // The fused push (offload.proto): only at a column-step boundary, from a real slot.
  if (req.fuse_push() && !req.column_steps())
    return absl::InvalidArgumentError("fuse_push: only with column_steps");
  if (req.fuse_push() && req.fused_grad_slot() > 1)
    return absl::InvalidArgumentError(
        absl::StrCat("fused_grad_slot: ", req.fused_grad_slot(), " is not 0 or 1"));
  if (req.skip_params_size() > 0 && !req.column_steps())
    return absl::InvalidArgumentError("skip_params: only with column_steps");
  if (req.predict() && !req.column_steps())
    return absl::InvalidArgumentError("predict: only with column_steps");
  UpdatePlan plan;
  plan.skip.assign(layout.params.size(), 0);
  for (const std::string& name : req.skip_params()) {
    const int64_t i = layout.Find(name);
    if (i < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("skip_params: no parameter '", name, "' in session ", session_id));
    if (plan.skip[i]++)
      return absl::InvalidArgumentError(absl::StrCat("skip_params: '", name, "' twice"));
  }
  plan.config.lr = h.lr();
  plan.config.beta1 = h.beta1();
  plan.config.beta2 = h.beta2();
  plan.config.eps = h.eps();
  plan.config.weight_decay = h.weight_decay();
  plan.config.step = req.step();
  plan.config.predict_out = req.predict();
  plan.param_slot = req.param_slot();
  plan.out = *out;
  plan.column_steps = req.column_steps();
  plan.fuse_push = req.fuse_push();
  plan.grad_slot = req.fused_grad_slot();
  if (!std::isfinite(req.push_scale()))
    return absl::InvalidArgumentError("push_scale: must be finite (0 means 1)");
  plan.push_scale = req.push_scale() == 0.0f ? 1.0f : req.push_scale();
  return plan;
}


namespace {
absl::StatusOr<MigratePlan> PlanOneMigration(const std::string& param,
                                             const google::protobuf::RepeatedField<int64_t>& cols,
                                             const google::protobuf::RepeatedField<int64_t>& steps,
                                             const SessionLayout& layout) {
  const int64_t which = layout.Find(param);
  if (which < 0)
    return absl::NotFoundError(absl::StrCat("param: no parameter '", param, "'"));
  const ParamLayout& p = layout.params[which];
  const int64_t n = cols.size();
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat("columns of '", p.name, "': empty"));
  if (steps.size() != n)
    return absl::InvalidArgumentError(absl::StrCat("steps of '", p.name, "': ", steps.size(),
                                                   " step counts for ", n, " columns"));
  // 4 blocks of [rows, n] must fit in the parameter's staging area of rows * cols floats.
  const int64_t blocks = 4;
  if (n > p.cols / blocks)
    return absl::InvalidArgumentError(absl::StrCat(
        "columns: ", n, " columns of '", p.name, "' need ", blocks * n * p.rows,
        " staging floats, but the parameter's staging area holds ", p.numel, "; move at most ",
        p.cols / blocks, " columns per call"));
  std::vector<bool> seen(static_cast<size_t>(p.cols), false);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t c = cols[j];
    if (c < 0 || c >= p.cols)
      return absl::InvalidArgumentError(absl::StrCat(
          "columns[", j, "]: ", c, " is outside [0, ", p.cols, ") of '", p.name, "'"));
    if (seen[c])
      return absl::InvalidArgumentError(
          absl::StrCat("columns[", j, "]: column ", c, " of '", p.name, "' appears twice"));
    seen[c] = true;
    if (steps[j] < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("steps[", j, "] of '", p.name, "': ", steps[j], " is negative"));
  }
  MigratePlan plan;
  plan.param = static_cast<size_t>(which);
  plan.columns.assign(cols.begin(), cols.end());
  plan.steps.assign(steps.begin(), steps.end());
  return plan;
}
}  // namespace

absl::StatusOr<std::vector<MigratePlan>> PlanMigrate(const v1::MigrateColumnsRequest& req,
                                                     const SessionLayout& layout) {
  if (!req.handover())
    return absl::InvalidArgumentError(
        "handover: must be true; stallfreed migrates columns only as a handover (the quiescent "
        "migration of stallfree 0.1 is gone)");
  std::vector<MigratePlan> plans;
  ASSIGN_OR_RETURN(MigratePlan first,
                   PlanOneMigration(req.param(), req.columns(), req.steps(), layout));
  plans.push_back(std::move(first));
  for (const v1::ColumnHandover& h : req.more()) {
    ASSIGN_OR_RETURN(MigratePlan plan,
                     PlanOneMigration(h.param(), h.columns(), h.steps(), layout));
    for (const MigratePlan& earlier : plans)
      if (earlier.param == plan.param)
        return absl::InvalidArgumentError(
            absl::StrCat("more: parameter '", h.param(), "' appears twice"));
    plans.push_back(std::move(plan));
  }
  // Each parameter's blocks follow the previous one's in the staging area, from its start; all
  // must fit (each term is below 4 * 2^40 floats: no overflow).
  const uint64_t staging_floats = layout.region.staging_bytes() / 4;
  uint64_t at = 0;
  for (MigratePlan& plan : plans) {
    const ParamLayout& p = layout.params[plan.param];
    plan.staging_at = at;
    at += 4 * static_cast<uint64_t>(p.rows) * plan.columns.size();
  }
  if (at > staging_floats)
    return absl::InvalidArgumentError(absl::StrCat(
        "columns: this migration needs ", at * 4,
        " staging bytes (4 fp32 blocks of [rows, columns] per parameter), the staging area holds ",
        layout.region.staging_bytes(), "; move fewer columns per call"));
  return plans;
}

namespace {
absl::Status CheckChunk(uint64_t offset, uint64_t length, uint64_t total_bytes,
                        const SessionLayout& layout) {
  const uint64_t staging_bytes = layout.region.staging_bytes();
  if (length > staging_bytes)
    return absl::InvalidArgumentError(absl::StrCat(
        "length: ", length, " bytes, the staging area holds ", staging_bytes));
  if (offset > total_bytes || length > total_bytes - offset)
    return absl::InvalidArgumentError(absl::StrCat("offset + length: ", offset, " + ", length,
                                                   " exceeds total_bytes ", total_bytes));
  return absl::OkStatus();
}
}  // namespace

absl::Status CheckChunk(const v1::WriteCheckpointRequest& req, const SessionLayout& layout) {
  return CheckChunk(req.offset(), req.length(), req.total_bytes(), layout);
}

absl::Status CheckChunk(const v1::ImportStateRequest& req, const SessionLayout& layout) {
  RETURN_IF_ERROR(CheckChunk(req.offset(), req.length(), req.total_bytes(), layout));
  if (req.length() == 0 && req.offset() < req.total_bytes())
    return absl::InvalidArgumentError(absl::StrCat(
        "length: 0 at offset ", req.offset(), " of ", req.total_bytes(), ": no progress"));
  return absl::OkStatus();
}

}  // namespace stallfree
