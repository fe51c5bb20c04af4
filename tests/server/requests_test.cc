// The request checks of server/requests.h that size the host footprint: LayOutParams's region
// (gradient slots in each parameter's gradient dtype, parameter slots in the registered parameter
// dtype and count, a staging area of 1/32 of the state with its floors), and the plans that
// move bytes through that staging area (chunked LoadParams, migrations packed one parameter
// after another) or write the parameter slots (Update's slot and output dtype).
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/offload_session.h"
#include "server/requests.h"

namespace stallfree {
namespace {

using Code = absl::StatusCode;

constexpr uint64_t kPage = 4096;

uint64_t Pages(uint64_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  v1::DType grad = v1::DTYPE_BF16;
};

v1::RegisterParamsRequest Request(const std::vector<Spec>& specs,
                                  v1::DType param_dtype = v1::DTYPE_UNSPECIFIED,
                                  uint32_t param_slots = 0) {
  v1::RegisterParamsRequest req;
  for (const Spec& s : specs) {
    v1::ParamSpec* p = req.add_params();
    p->set_name(s.name);
    for (int64_t d : s.shape) p->add_shape(d);
    p->set_grad_dtype(s.grad);
  }
  req.set_param_dtype(param_dtype);
  req.set_param_slots(param_slots);
  return req;
}

// The cold part of the measured model of the README (3 x Linear(1024, 1024), top-k 0.1: 922 of
// 1024 columns in the daemon), as the ZenFlow engine registers it.
std::vector<Spec> ColdModel(v1::DType grad) {
  return {{"0.weight", {1024, 922}, grad}, {"1.weight", {1024, 922}, grad},
          {"2.weight", {1024, 922}, grad}};
}
constexpr uint64_t kColdElems = 3 * 1024 * 922;  // 2,832,384: a multiple of 16 (and of 1024)
// The state's arrays lie kColdElems + 272 elements apart (StateStride: staggered by 1088 bytes
// within a page, kColdElems being a multiple of 1024).
constexpr uint64_t kStride = kColdElems + 272;
// The session record before the arrays (server/session_record.h): two commits of 8 bytes a
// column (3 x 922 columns) and the identity, 11 pages.
constexpr uint64_t kRecordPages = 11 * 4096;
// The work journal (server/session_journal.h) from the page after the arrays: its header (32
// bytes), its entry (16 + a plan room, the larger of an Update's or a push's, 256 + 32 x (2 x 3 +
// 64) = 2496, and a handover's, 64 + 16 x 3 + 24 x (2766 / 4 + 3) = 16768 (24 bytes for each
// column it can move, a quarter of each parameter's), + an 8-byte checksum), 2 slot headers and
// the done bitmap of 2766 units of 1024 elements (44 words), to 64 bytes: 17216; then 2 slots of
// 3 x 1024 floats (24 KiB).
constexpr uint64_t kJournalAt = (kRecordPages + 16 * kStride + 4095) / 4096 * 4096;
constexpr uint64_t kJournalBytes = 17216 + 2 * 3 * 1024 * 4;

// bf16 in and out, one parameter slot (what ZenFlowAdamW's default registers): 2 x 2 bytes of
// gradient slots, 2 bytes of parameter slot, 4/32 of staging and 16 of fp32 state per element.
TEST(LayOutParams, Bf16TransfersOneSlotTakeAbout22BytesPerElement) {
  absl::StatusOr<SessionLayout> l =
      LayOutParams(Request(ColdModel(v1::DTYPE_BF16), v1::DTYPE_BF16, 1));
  ASSERT_TRUE(l.ok()) << l.status();
  const v1::RegionLayout& r = l->region;
  EXPECT_EQ(l->total_elems, kColdElems);
  EXPECT_EQ(r.grad_slot_bytes(), Pages(2 * kColdElems));
  EXPECT_EQ(r.param_slots(), 1u);
  EXPECT_EQ(r.param_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(r.param_slot_offset(), 2 * r.grad_slot_bytes());
  EXPECT_EQ(r.param_slot_bytes(), Pages(2 * kColdElems));
  EXPECT_EQ(r.staging_offset(), r.param_slot_offset() + r.param_slot_bytes());
  EXPECT_EQ(r.staging_bytes(), Pages(kColdElems / 32 * 4));
  EXPECT_EQ(r.region_bytes(), r.staging_offset() + r.staging_bytes());
  EXPECT_EQ(l->state_stride, kStride);
  EXPECT_EQ(l->arrays_offset, kRecordPages);
  EXPECT_EQ(l->journal_offset, kJournalAt);
  EXPECT_EQ(l->journal.bytes, kJournalBytes);
  EXPECT_EQ(l->state_bytes, kJournalAt + kJournalBytes);
  EXPECT_EQ(l->pinned_bytes(), 2 * Pages(2 * kColdElems) + Pages(2 * kColdElems) +
                                   Pages(kColdElems / 8) + kJournalAt + kJournalBytes);
  // A state of the record format before (2), adopted, keeps the journal it was laid out with:
  // the plan room of an Update's or a push's alone, 2944 bytes of header, entry and bitmap.
  absl::StatusOr<SessionLayout> before = LayOutParams(
      Request(ColdModel(v1::DTYPE_BF16), v1::DTYPE_BF16, 1), kRecordFormatNoHandovers);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->journal.bytes, 2944u + 2 * 3 * 1024 * 4);
  EXPECT_EQ(before->state_bytes, kJournalAt + 2944 + 2 * 3 * 1024 * 4);
  EXPECT_EQ(before->record_format, kRecordFormatNoHandovers);
  EXPECT_EQ(l->record_format, kRecordFormat);
  const double per_elem = static_cast<double>(l->pinned_bytes()) / kColdElems;
  // The padding and the record: 0.019 an element; the journal from its page on: 0.015 (0.005 of
  // it the room of a handover's plan).
  EXPECT_LE(per_elem, 22.125 + 0.035);
  EXPECT_GE(per_elem, 22.125);
  // Per model parameter (3 x (1024 x 1024 + 1024), the rest on the device): at most 20.
  EXPECT_LE(static_cast<double>(l->pinned_bytes()) / (3 * (1024 * 1024 + 1024)), 20.0);
  for (const v1::ParamLayout& p : r.params())
    EXPECT_LE(p.param_offset_bf16() + 2 * static_cast<uint64_t>(p.numel()), r.param_slot_bytes())
        << p.name();
}

// fp32 in and out, one slot: 2 x 4 + 4 + 4/32 + 16.
TEST(LayOutParams, Fp32TransfersOneSlotTakeAbout28BytesPerElement) {
  absl::StatusOr<SessionLayout> l =
      LayOutParams(Request(ColdModel(v1::DTYPE_FP32), v1::DTYPE_FP32, 1));
  ASSERT_TRUE(l.ok()) << l.status();
  const v1::RegionLayout& r = l->region;
  EXPECT_EQ(r.grad_slot_bytes(), Pages(4 * kColdElems));
  EXPECT_EQ(r.param_slot_bytes(), Pages(4 * kColdElems));
  EXPECT_EQ(r.param_dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(r.staging_bytes(), Pages(kColdElems / 8));
  EXPECT_EQ(r.region_bytes(), 3 * Pages(4 * kColdElems) + Pages(kColdElems / 8));
  const double per_elem = static_cast<double>(l->pinned_bytes()) / kColdElems;
  EXPECT_GE(per_elem, 28.125);
  EXPECT_LE(per_elem, 28.125 + 0.035);
}

// A request without the new fields (an older client): two fp32 parameter slots and a staging
// area of all the values, the layout it was written for (a whole LoadParams of any size works).
TEST(LayOutParams, UnspecifiedSlotCountMeansTheLayoutOfBefore) {
  absl::StatusOr<SessionLayout> l = LayOutParams(Request(ColdModel(v1::DTYPE_BF16)));
  ASSERT_TRUE(l.ok()) << l.status();
  const v1::RegionLayout& r = l->region;
  EXPECT_EQ(r.param_slots(), 2u);
  EXPECT_EQ(r.param_dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(r.param_slot_bytes(), Pages(4 * kColdElems));
  EXPECT_EQ(r.staging_offset(), r.param_slot_offset() + 2 * r.param_slot_bytes());
  EXPECT_EQ(r.staging_bytes(), Pages(4 * kColdElems));
  EXPECT_EQ(r.region_bytes(), 2 * Pages(2 * kColdElems) + 3 * Pages(4 * kColdElems));
  EXPECT_EQ(l->pinned_bytes(), 2 * Pages(2 * kColdElems) + 3 * Pages(4 * kColdElems) +
                                   kJournalAt + kJournalBytes);
  v1::LoadParamsRequest whole;
  EXPECT_TRUE(PlanLoad(whole, *l).ok());
  // bf16 slots, two of them: half the bytes each.
  l = LayOutParams(Request(ColdModel(v1::DTYPE_BF16), v1::DTYPE_BF16, 2));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->region.param_slots(), 2u);
  EXPECT_EQ(l->region.param_slot_bytes(), Pages(2 * kColdElems));
}

// The staging area's floors: a small session stages all of its values (a whole LoadParams works
// as it always did), and a tall parameter's single column migrates (4 blocks of its rows).
TEST(LayOutParams, StagingFloorsHoldASmallSessionAndOneColumnOfTheTallestParameter) {
  absl::StatusOr<SessionLayout> l =
      LayOutParams(Request({{"w", {100, 30}}, {"b", {30}}}, v1::DTYPE_BF16, 1));
  ASSERT_TRUE(l.ok());
  EXPECT_GE(l->region.staging_bytes(), 4 * l->total_elems);
  for (const v1::ParamLayout& p : l->region.params())
    EXPECT_LE(p.staging_offset() + 4 * static_cast<uint64_t>(p.numel()),
              l->region.staging_bytes());
  // 20000 x 40 = 800000 elements: 1/32 is 25000 floats, one column's 4 blocks 80000.
  l = LayOutParams(Request({{"tall", {20000, 40}}}, v1::DTYPE_BF16, 1));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->region.staging_bytes(), Pages(4 * 4 * 20000));
  // 4000 x 400: 1/32 (50000 floats) is more than 64 KiB and than 4 x 4000.
  l = LayOutParams(Request({{"w", {4000, 400}}}, v1::DTYPE_BF16, 1));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->region.staging_bytes(), Pages(4000 * 400 / 32 * 4));
  // 1000 x 100: a whole copy (100000 floats) is more than 64 KiB: 64 KiB.
  l = LayOutParams(Request({{"w", {1000, 100}}}, v1::DTYPE_BF16, 1));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->region.staging_bytes(), 16384u * 4);
}

TEST(LayOutParams, BadParameterDtypeOrSlotCountIsRefused) {
  v1::RegisterParamsRequest req = Request({{"w", {4, 4}}}, v1::DTYPE_BF16, 3);
  absl::StatusOr<SessionLayout> l = LayOutParams(req);
  EXPECT_EQ(l.status().code(), Code::kInvalidArgument);
  EXPECT_NE(l.status().message().find("param_slots"), std::string::npos) << l.status();
  req = Request({{"w", {4, 4}}}, static_cast<v1::DType>(7), 1);
  l = LayOutParams(req);
  EXPECT_EQ(l.status().code(), Code::kInvalidArgument);
  EXPECT_NE(l.status().message().find("param_dtype"), std::string::npos) << l.status();
}

// A large session: whole loads of what does not fit are refused with the way out; ranges load
// it in chunks, checked against the parameter and the staging area.
TEST(PlanLoad, RangesChunkALargeSessionThroughTheStagingArea) {
  absl::StatusOr<SessionLayout> l =
      LayOutParams(Request({{"a", {512, 256}}, {"b", {512, 256}}}, v1::DTYPE_BF16, 1));
  ASSERT_TRUE(l.ok());
  const uint64_t cap = l->region.staging_bytes() / 4;
  ASSERT_LT(cap, 2u * 512 * 256);
  v1::LoadParamsRequest whole;
  absl::StatusOr<std::vector<LoadJob>> jobs = PlanLoad(whole, *l);
  EXPECT_EQ(jobs.status().code(), Code::kInvalidArgument);
  EXPECT_NE(jobs.status().message().find("load it by ranges"), std::string::npos)
      << jobs.status();

  v1::LoadParamsRequest req;
  v1::LoadRange* r = req.add_ranges();
  r->set_param("b");
  r->set_first_element(1000);
  r->set_count(cap - 8);
  r->set_staging_offset(32);
  jobs = PlanLoad(req, *l);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].param, 1u);
  EXPECT_EQ((*jobs)[0].first, 1000u);
  EXPECT_EQ((*jobs)[0].count, cap - 8);
  EXPECT_EQ((*jobs)[0].staging_at, 8u);

  r->set_count(cap - 7);  // one float past the staging area
  EXPECT_EQ(PlanLoad(req, *l).status().code(), Code::kInvalidArgument);
  r->set_count(10);
  r->set_staging_offset(6);  // not a float
  EXPECT_EQ(PlanLoad(req, *l).status().code(), Code::kInvalidArgument);
  r->set_staging_offset(0);
  r->set_first_element(512 * 256 - 9);  // one past the parameter
  EXPECT_EQ(PlanLoad(req, *l).status().code(), Code::kInvalidArgument);
  r->set_first_element(UINT64_MAX - 2);  // overflow
  EXPECT_EQ(PlanLoad(req, *l).status().code(), Code::kInvalidArgument);
  r->set_first_element(0);
  r->set_param("nope");
  EXPECT_EQ(PlanLoad(req, *l).status().code(), Code::kNotFound);
  r->set_param("a");
  req.add_names("a");
  EXPECT_EQ(PlanLoad(req, *l).status().code(), Code::kInvalidArgument);
}

// A handover's parameters are packed one after the other from the start of the staging area; a
// request larger than the staging area is refused with both sizes.
TEST(PlanMigrate, HandoverBlocksArePackedAndMustFitTheStagingArea) {
  absl::StatusOr<SessionLayout> l = LayOutParams(
      Request({{"a", {2048, 64}}, {"b", {1024, 64}}}, v1::DTYPE_BF16, 1));
  ASSERT_TRUE(l.ok());
  const uint64_t cap = l->region.staging_bytes() / 4;  // 16384 floats (64 KiB)
  ASSERT_EQ(cap, 16384u);
  v1::MigrateColumnsRequest req;
  req.set_handover(true);
  req.set_param("a");
  req.add_columns(3);  // 4 x 2048 floats
  req.add_steps(1);
  v1::ColumnHandover* more = req.add_more();
  more->set_param("b");
  for (int64_t c : {5, 9}) {  // 4 x 1024 x 2: exactly full
    more->add_columns(c);
    more->add_steps(2);
  }
  absl::StatusOr<std::vector<MigratePlan>> plans = PlanMigrate(req, *l);
  ASSERT_TRUE(plans.ok()) << plans.status();
  ASSERT_EQ(plans->size(), 2u);
  EXPECT_EQ((*plans)[0].staging_at, 0u);
  EXPECT_EQ((*plans)[1].staging_at, 4u * 2048u);
  more->add_columns(11);  // 4 x 2048 + 4 x 1024 x 3 = 20480 floats > 16384
  more->add_steps(2);
  plans = PlanMigrate(req, *l);
  EXPECT_EQ(plans.status().code(), Code::kInvalidArgument);
  EXPECT_NE(plans.status().message().find("81920 staging bytes"), std::string::npos)
      << plans.status();
  EXPECT_NE(plans.status().message().find("holds 65536"), std::string::npos) << plans.status();
  // A migration that is not a handover (stallfree 0.1's quiescent swap) is refused, naming it.
  v1::MigrateColumnsRequest plain;
  plain.set_param("a");
  plain.add_columns(0);
  plain.add_steps(0);
  plans = PlanMigrate(plain, *l);
  EXPECT_EQ(plans.status().code(), Code::kInvalidArgument);
  EXPECT_NE(plans.status().message().find("handover"), std::string::npos) << plans.status();
}

// Update and Restore write what the slots hold: the slot index below the session's count, FP32
// only into FP32 slots, UNSPECIFIED the registered dtype.
TEST(PlanUpdate, SlotAndOutputDtypeFollowTheRegistration) {
  absl::StatusOr<SessionLayout> bf16 = LayOutParams(Request({{"w", {8, 8}}}, v1::DTYPE_BF16, 1));
  absl::StatusOr<SessionLayout> fp32 = LayOutParams(Request({{"w", {8, 8}}}));
  ASSERT_TRUE(bf16.ok() && fp32.ok());
  v1::UpdateRequest req;
  req.set_step(1);
  req.mutable_hyper()->set_lr(1e-3);
  req.mutable_hyper()->set_beta1(0.9);
  req.mutable_hyper()->set_beta2(0.999);
  req.mutable_hyper()->set_eps(1e-8);
  absl::StatusOr<UpdatePlan> plan = PlanUpdate(req, *bf16, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->out, v1::DTYPE_BF16);
  plan = PlanUpdate(req, *fp32, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->out, v1::DTYPE_FP32);
  req.set_out_dtype(v1::DTYPE_BF16);
  EXPECT_TRUE(PlanUpdate(req, *fp32, 1).ok());  // fp32 slots take bf16 as before
  req.set_out_dtype(v1::DTYPE_FP32);
  EXPECT_EQ(PlanUpdate(req, *bf16, 1).status().code(), Code::kFailedPrecondition);
  req.set_out_dtype(v1::DTYPE_BF16);
  req.set_param_slot(1);
  plan = PlanUpdate(req, *bf16, 1);
  EXPECT_EQ(plan.status().code(), Code::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("1 parameter slot"), std::string::npos) << plan.status();
  EXPECT_TRUE(PlanUpdate(req, *fp32, 1).ok());
  EXPECT_EQ(OutputDType(v1::DTYPE_UNSPECIFIED, *bf16, "out_dtype").value(), v1::DTYPE_BF16);
  EXPECT_EQ(OutputDType(v1::DTYPE_FP32, *bf16, "out_dtype").status().code(),
            Code::kFailedPrecondition);
}

}  // namespace
}  // namespace stallfree
