#include "server/session_journal.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include <tbb/blocked_range.h>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/tbb_sync.h"
#include "kernels/undo_log.h"

namespace stallfree {
namespace {

constexpr char kMagic[8] = {'S', 'F', 'J', 'R', 'N', 'L', '0', '1'};
constexpr uint64_t kHeaderBytes = 8 + 4 + 4 + 8 + 8;
constexpr uint64_t kOpHeaderBytes = 8 + 4 + 4;
constexpr uint32_t kMaxArrays = 3;

uint64_t Align(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

std::atomic<int64_t> unit_delay_us{0};
std::atomic<int64_t> piece_delay_us{0};

// The window of a slot header (kernels::UndoMark) for a unit copied whole when it went on from
// its `done` (a unit cut short in the kernels' pass, finished by a backend that keeps no undo
// log): the slot holds the unit, its elements below `done` already finished.
constexpr uint64_t kCopiedWhole = 31;

// Keeps the stores before it before the stores after it in the program's order. That is all a
// crash needs on x86-64, whose stores become visible in program order (TSO); the order is not
// between threads (a unit is one worker's), so no fence instruction is needed.
inline void OrderStores() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

}  // namespace

void SetUnitDelayForTesting(int64_t microseconds) { unit_delay_us.store(microseconds); }
void SetPieceDelayForTesting(int64_t microseconds) { piece_delay_us.store(microseconds); }

JournalGeometry JournalGeometryFor(uint64_t total_elems, size_t params, uint64_t columns) {
  JournalGeometry g;
  // A slot per worker, up to one per Mi elements: a large session runs on up to 32 workers at
  // once, and a small one's journal stays small (2 slots, and units of about 1/128 of its
  // elements: the slots' copies are at most 3/64 of one array, 24 KiB from 128 Ki elements).
  g.slots = static_cast<uint32_t>(std::clamp<uint64_t>(total_elems >> 20, 2, 32));
  g.unit = std::clamp<uint64_t>(total_elems / 128 / 16 * 16, 256, kJournalMaxUnit);
  g.units = (total_elems + g.unit - 1) / g.unit;
  // An Update's plan: its fixed fields and a byte per parameter; a push's: 32 bytes per job, a
  // whole-slot push has one job per parameter.
  // A handover's: 16 bytes per parameter and 24 per column moved (at most a quarter of each
  // parameter's columns: requests.cc, PlanMigrate).
  g.plan_capacity = Align(std::max<uint64_t>(256 + 32 * (2 * static_cast<uint64_t>(params) + 64),
                                             64 + 16 * static_cast<uint64_t>(params) +
                                                 24 * (columns / 4 + params)),
                          8);
  const uint64_t before_data = kHeaderBytes + kOpHeaderBytes + g.plan_capacity + 8 +
                               8 * static_cast<uint64_t>(g.slots) + 8 * ((g.units + 63) / 64);
  g.bytes = Align(before_data, 64) + static_cast<uint64_t>(g.slots) * kMaxArrays * g.unit * 4;
  return g;
}

uint64_t WorkJournal::OpBytes() const { return kOpHeaderBytes + g_.plan_capacity + 8; }

uint64_t* WorkJournal::SlotHeaders() const {
  return reinterpret_cast<uint64_t*>(data_ + kHeaderBytes + OpBytes());
}

uint64_t* WorkJournal::DoneBits() const { return SlotHeaders() + g_.slots; }

float* WorkJournal::SlotData(uint32_t slot) const {
  const uint64_t at = Align(kHeaderBytes + OpBytes() + 8 * static_cast<uint64_t>(g_.slots) +
                                8 * ((g_.units + 63) / 64),
                            64);
  return reinterpret_cast<float*>(data_ + at) + static_cast<uint64_t>(slot) * kMaxArrays * g_.unit;
}

void WorkJournal::Format() {
  memset(data_, 0, g_.bytes - static_cast<uint64_t>(g_.slots) * kMaxArrays * g_.unit * 4);
  memcpy(data_, kMagic, 8);
  const uint32_t unit = static_cast<uint32_t>(g_.unit);
  memcpy(data_ + 8, &g_.slots, 4);
  memcpy(data_ + 12, &unit, 4);
  memcpy(data_ + 16, &g_.units, 8);
  memcpy(data_ + 24, &g_.plan_capacity, 8);
}

absl::Status WorkJournal::CheckHeader() const {
  uint32_t slots, unit;
  uint64_t units, capacity;
  memcpy(&slots, data_ + 8, 4);
  memcpy(&unit, data_ + 12, 4);
  memcpy(&units, data_ + 16, 8);
  memcpy(&capacity, data_ + 24, 8);
  if (memcmp(data_, kMagic, 8) != 0 || slots != g_.slots || unit != g_.unit ||
      units != g_.units || capacity != g_.plan_capacity)
    return absl::DataLossError(absl::StrCat(
        "the session's work journal is not the one its layout gives (", slots, " slots of ",
        unit, " elements, ", units, " units; expected ", g_.slots, ", ", g_.unit, ", ",
        g_.units, ")"));
  return absl::OkStatus();
}

absl::Status WorkJournal::Begin(uint64_t commit_sequence, JournalOp kind,
                                const std::string& plan) {
  uint8_t* op = data_ + kHeaderBytes;
  // The entry goes invalid first (its checksum no longer matches once the sequence changes),
  // then the slots and the bitmap are cleared, then the entry is written whole.
  const uint64_t none = 0;
  memcpy(op, &none, 8);
  OrderStores();
  ClearDone();
  if (plan.size() > g_.plan_capacity)
    return absl::InvalidArgumentError(absl::StrCat(
        "the operation's plan of ", plan.size(), " bytes exceeds the work journal's ",
        g_.plan_capacity));
  const uint32_t k = static_cast<uint32_t>(kind), n = static_cast<uint32_t>(plan.size());
  memcpy(op + 8, &k, 4);
  memcpy(op + 12, &n, 4);
  if (n > 0) memcpy(op + kOpHeaderBytes, plan.data(), n);
  OrderStores();
  memcpy(op, &commit_sequence, 8);
  Checksum64 c;
  c.Update(op, kOpHeaderBytes + n);
  const uint64_t sum = c.Digest();
  memcpy(op + kOpHeaderBytes + g_.plan_capacity, &sum, 8);
  OrderStores();
  return absl::OkStatus();
}

absl::StatusOr<JournalEntry> WorkJournal::Entry() const {
  const uint8_t* op = data_ + kHeaderBytes;
  JournalEntry e;
  uint32_t k, n;
  memcpy(&e.commit_sequence, op, 8);
  memcpy(&k, op + 8, 4);
  memcpy(&n, op + 12, 4);
  if (n > g_.plan_capacity || k > static_cast<uint32_t>(JournalOp::kHandover))
    return absl::DataLossError("the work journal's entry is cut short");
  Checksum64 c;
  c.Update(op, kOpHeaderBytes + n);
  uint64_t sum;
  memcpy(&sum, op + kOpHeaderBytes + g_.plan_capacity, 8);
  if (sum != c.Digest()) return absl::DataLossError("the work journal's entry is cut short");
  e.kind = static_cast<JournalOp>(k);
  e.plan.assign(reinterpret_cast<const char*>(op + kOpHeaderBytes), n);
  return e;
}

void WorkJournal::ClearDone() {
  resume_.clear();
  memset(DoneBits(), 0, 8 * ((g_.units + 63) / 64));
  for (uint32_t s = 0; s < g_.slots; ++s) __atomic_store_n(&SlotHeaders()[s], 0, __ATOMIC_RELAXED);
  OrderStores();
}

bool WorkJournal::done(uint64_t unit) const {
  return (__atomic_load_n(&DoneBits()[unit / 64], __ATOMIC_ACQUIRE) >> (unit % 64)) & 1;
}

uint64_t WorkJournal::done_units() const {
  uint64_t n = 0;
  for (uint64_t w = 0; w < (g_.units + 63) / 64; ++w) n += __builtin_popcountll(DoneBits()[w]);
  return n;
}

void WorkJournal::MarkDone(uint64_t first, uint64_t n) {
  for (uint64_t u = first; u < first + n;) {  // a word of the bitmap at a time
    const uint64_t bits = std::min<uint64_t>(first + n - u, 64 - u % 64);
    const uint64_t mask = (bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1) << (u % 64);
    __atomic_fetch_or(&DoneBits()[u / 64], mask, __ATOMIC_RELEASE);
    u += bits;
  }
}

void WorkJournal::Save(const std::vector<float*>& arrays, uint64_t b, uint64_t e,
                       float* saved) const {
  const uint64_t n = e - b;
  for (size_t a = 0; a < arrays.size(); ++a)
    memcpy(saved + a * g_.unit, arrays[a] + b, n * sizeof(float));
}

void WorkJournal::Run(uint64_t elems, const std::vector<float*>& arrays,
                      const std::function<void(uint64_t, uint64_t)>& work,
                      const std::function<bool(uint64_t)>& skip, Saving saving,
                      const std::function<bool(uint64_t)>& copy_first) {
  const bool in_kernels = saving == Saving::kInKernels && arrays.size() == 3;
  const uint64_t units = (elems + g_.unit - 1) / g_.unit;
  // A unit a kill cut short in the kernels' pass goes on from where it stopped, in the slot
  // that names it (RollBackTorn): another worker must not take that slot first.
  std::vector<std::pair<uint64_t, uint64_t>> resume(g_.slots, {units, 0});  // unit, from
  std::vector<bool> resuming(units, false);
  bool any_resume = false;
  for (const auto& [slot, at] : resume_)
    if (at.first < units && !done(at.first) && !(skip && skip(at.first))) {
      resume[slot] = at;
      resuming[at.first] = any_resume = true;
    }
  resume_.clear();
  std::vector<uint64_t> todo;
  todo.reserve(units);
  for (uint64_t u = 0; u < units; ++u)
    if (!done(u) && !resuming[u] && !(skip && skip(u))) todo.push_back(u);
  if (todo.empty() && !any_resume) return;
  std::atomic<uint64_t> next{0};
  const int64_t delay_us = unit_delay_us.load(std::memory_order_relaxed);
  auto by_kernels = [&](uint64_t u) { return in_kernels && !(copy_first && copy_first(u)); };
  // Units [u, u + n) from element `from` of the first: in the kernels' pass, consecutive units
  // go as one span (one kernel call per piece of the work instead of one per unit and piece;
  // session_journal.h says what a call costs), the header naming the span's first unit and the
  // mark counting from the span's start.
  auto run_span = [&](uint32_t slot, uint64_t u, uint64_t n, uint64_t from) {
    float* saved = SlotData(slot);
    const uint64_t b = u * g_.unit, e = std::min(elems, (u + n) * g_.unit);
    kernels::UndoLog log;
    std::optional<kernels::ScopedUndoLog> keep;
    if (by_kernels(u)) {
      __atomic_store_n(&SlotHeaders()[slot], kernels::UndoMark(u + 1, from, 0),
                       __ATOMIC_RELEASE);
      OrderStores();
      for (int a = 0; a < 3; ++a) log.base[a] = arrays[a] + b;
      log.ring = saved;  // 3 * kUndoRing floats, at most a third of the slot
      log.elems = e - b;
      log.mark = &SlotHeaders()[slot];
      log.tag = u + 1;
      keep.emplace(&log);
    } else {
      Save(arrays, b, e, saved);
      __atomic_store_n(&SlotHeaders()[slot],
                       from == 0 ? u + 1 : kernels::UndoMark(u + 1, from, kCopiedWhole),
                       __ATOMIC_RELEASE);
    }
    if (delay_us > 0) {
      // Testing: the unit half changed while it waits, as a crash can leave it.
      const uint64_t mid = b + from + (e - b - from) / 32 * 16;
      work(b + from, mid);
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      work(mid, e);
    } else {
      work(b + from, e);
    }
    keep.reset();
    MarkDone(u, n);
  };
  // Units are taken a batch at a time, so that each worker's streams through the arrays run on
  // across its units (the hardware prefetchers keep up) and the shared counter is touched once
  // per batch. A batch's consecutive units in the kernels' pass are one span (one unit at a
  // time with the testing delay, which is per unit).
  constexpr uint64_t kBatch = 32;
  static_assert(kBatch * kJournalMaxUnit <= kernels::kUndoMaxElems, "a span must fit the log");
  auto worker = [&](uint32_t slot) {
    if (resume[slot].first < units) run_span(slot, resume[slot].first, 1, resume[slot].second);
    for (uint64_t first = next.fetch_add(kBatch); first < todo.size();
         first = next.fetch_add(kBatch)) {
      const uint64_t last = std::min<uint64_t>(todo.size(), first + kBatch);
      for (uint64_t i = first; i < last;) {
        uint64_t j = i + 1;
        if (by_kernels(todo[i]) && delay_us == 0)
          while (j < last && todo[j] == todo[j - 1] + 1 && by_kernels(todo[j])) ++j;
        run_span(slot, todo[i], j - i, 0);
        i = j;
      }
    }
  };
  OnSlots(any_resume ? g_.slots
                     : static_cast<uint32_t>(std::min<uint64_t>(g_.slots, todo.size())),
          worker);
}

void WorkJournal::OnSlots(uint32_t tasks, const std::function<void(uint32_t)>& worker) {
  if (tasks == 1) {
    worker(0);
    return;
  }
  // One task per slot, each taking work from the caller's shared counter until none is left.
  ParallelFor(tbb::blocked_range<uint32_t>(0, tasks, 1),
              [&](const tbb::blocked_range<uint32_t>& r) {
                for (uint32_t s = r.begin(); s < r.end(); ++s) worker(s);
              });
}

namespace {
// A handover piece's slot header: the piece + 1 and its phase (session_journal.h, the layout).
constexpr uint64_t kPieceBits = 48;
uint64_t PieceHeader(uint64_t piece, uint64_t phase) { return (piece + 1) | (phase << kPieceBits); }
}  // namespace

void WorkJournal::RunPieces(uint64_t pieces, const PhasedWork& work) {
  std::vector<uint64_t> todo;
  for (uint64_t p = 0; p < pieces; ++p)
    if (!done(p)) todo.push_back(p);
  if (todo.empty()) return;
  const int64_t delay_us = piece_delay_us.load(std::memory_order_relaxed);
  std::atomic<uint64_t> next{0};
  auto worker = [&](uint32_t slot) {
    float* saved = SlotData(slot);
    uint64_t* header = &SlotHeaders()[slot];
    for (uint64_t i = next.fetch_add(1); i < todo.size(); i = next.fetch_add(1)) {
      const uint64_t p = todo[i];
      work.save(p, saved);
      OrderStores();
      __atomic_store_n(header, PieceHeader(p, 1), __ATOMIC_RELEASE);
      OrderStores();
      PieceFrom(header, p, 1, saved, work, delay_us);
    }
  };
  OnSlots(static_cast<uint32_t>(std::min<uint64_t>(g_.slots, todo.size())), worker);
}

absl::Status WorkJournal::FinishTornPieces(uint64_t pieces, const PhasedWork& work) {
  resume_.clear();
  for (uint32_t s = 0; s < g_.slots; ++s) {
    uint64_t* header = &SlotHeaders()[s];
    const uint64_t h = __atomic_load_n(header, __ATOMIC_ACQUIRE);
    const uint64_t tag = h & ((uint64_t{1} << kPieceBits) - 1), phase = h >> kPieceBits;
    if (tag == 0) continue;
    if (tag > pieces || phase < 1 || phase > 2)
      return absl::DataLossError(absl::StrCat("the work journal's slot ", s, " names piece ",
                                              tag - 1, " in phase ", phase, " of a handover of ",
                                              pieces));
    const uint64_t p = tag - 1;
    if (done(p)) continue;
    PieceFrom(header, p, phase, SlotData(s), work, 0);
  }
  return absl::OkStatus();
}

void WorkJournal::PieceFrom(uint64_t* header, uint64_t piece, uint64_t phase, const float* saved,
                            const PhasedWork& work, int64_t delay_us) {
  if (phase == 1) {
    work.first(piece, saved);
    OrderStores();
    __atomic_store_n(header, PieceHeader(piece, 2), __ATOMIC_RELEASE);
    OrderStores();
  }
  // Testing: the piece half exchanged while it waits, as a crash can leave it.
  if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
  work.second(piece, saved);
  OrderStores();
  MarkDone(piece, 1);
}

absl::Status WorkJournal::RollBackTorn(uint64_t elems, const std::vector<float*>& arrays) {
  resume_.clear();
  // First, each slot's header in the kernels' pass is made a header of the one unit it stopped
  // in: the span's units before it are marked done, the window put back (in the next unit too,
  // when the vector in flight crossed into it), and the header rewritten to name the unit alone,
  // from where it stopped, with nothing in flight. Each step can be done again: a kill in the
  // middle of this leaves the same to do.
  for (uint32_t s = 0; s < g_.slots; ++s) {
    const uint64_t h = __atomic_load_n(&SlotHeaders()[s], __ATOMIC_ACQUIRE);
    const uint64_t tag = kernels::UndoMarkTag(h);
    if (tag == 0) continue;
    const uint64_t u0 = tag - 1;
    if (u0 >= g_.units || u0 * g_.unit >= elems)
      return absl::DataLossError(absl::StrCat("the work journal's slot ", s, " names unit ", u0,
                                              ", beyond the session's ", g_.units));
    const uint64_t window = kernels::UndoMarkWindow(h);
    if (kernels::UndoMarkWhole(h) || window == kCopiedWhole) continue;
    const uint64_t at = u0 * g_.unit + kernels::UndoMarkDone(h);  // the window's first element
    if (at + window > elems || window > kernels::kUndoMaxWindow || arrays.size() != 3)
      return absl::DataLossError(absl::StrCat(
          "the work journal's slot ", s, " names elements beyond the session (unit ", u0,
          ", done ", kernels::UndoMarkDone(h), ", window ", window, ")"));
    const uint64_t u = at / g_.unit;
    MarkDone(u0, u - u0);
    if (done(u)) continue;  // finished since (the header is an old one)
    const float* saved = SlotData(s);
    for (size_t a = 0; a < 3; ++a)
      memcpy(arrays[a] + at,
             saved + a * kernels::kUndoRing + kernels::UndoRingAt(at - u0 * g_.unit),
             window * sizeof(float));
    // The window's elements are as before now: the header names the unit alone, nothing in
    // flight (after the copy back: a kill before this store copies the same again).
    OrderStores();
    __atomic_store_n(&SlotHeaders()[s], kernels::UndoMark(u + 1, at - u * g_.unit, 0),
                     __ATOMIC_RELEASE);
  }
  // Then, per unit in flight, the slot that names it furthest on (a unit resumed after an
  // earlier kill can be named by two slots, the older one behind), put back and resumed.
  std::map<uint64_t, uint32_t> in_flight;
  for (uint32_t s = 0; s < g_.slots; ++s) {
    const uint64_t h = __atomic_load_n(&SlotHeaders()[s], __ATOMIC_ACQUIRE);
    if (kernels::UndoMarkTag(h) == 0) continue;
    const uint64_t u = kernels::UndoMarkTag(h) - 1;
    if (done(u)) continue;
    const uint64_t e = std::min(elems, u * g_.unit + g_.unit) - u * g_.unit;
    if (kernels::UndoMarkDone(h) > e)
      return absl::DataLossError(absl::StrCat("the work journal's slot ", s,
                                              " names elements beyond unit ", u));
    auto [it, inserted] = in_flight.emplace(u, s);
    if (inserted) continue;
    const uint64_t o = __atomic_load_n(&SlotHeaders()[it->second], __ATOMIC_ACQUIRE);
    if (std::make_pair(kernels::UndoMarkDone(h), kernels::UndoMarkWindow(h)) >
        std::make_pair(kernels::UndoMarkDone(o), kernels::UndoMarkWindow(o)))
      it->second = s;
  }
  for (const auto& [u, s] : in_flight) {
    const uint64_t h = __atomic_load_n(&SlotHeaders()[s], __ATOMIC_ACQUIRE);
    const uint64_t b = u * g_.unit, e = std::min(elems, b + g_.unit);
    const uint64_t done = kernels::UndoMarkDone(h), window = kernels::UndoMarkWindow(h);
    if (kernels::UndoMarkWhole(h) || window == kCopiedWhole) {
      // The elements below `done` were copied finished: putting them back changes nothing.
      const float* saved = SlotData(s);
      for (size_t a = 0; a < arrays.size(); ++a)
        memcpy(arrays[a] + b, saved + a * g_.unit, (e - b) * sizeof(float));
    }  // (a unit in the kernels' pass has its window back already)
    if (done > 0) resume_[s] = {u, done};
  }
  return absl::OkStatus();
}

}  // namespace stallfree
