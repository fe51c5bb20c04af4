// What the CPU parallel workers (run as ranks by the tests) share beyond worker_check.h: joining
// the group the launcher started (every worker's main); and for the TP+SP and TP x CP workers,
// the communicators' counters against their closed forms and the TP-sharded block case (the same
// full weights, data and single-rank reference on every rank, and this rank's weight-gradient
// shard against the reference's).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/reference_block.h"

namespace stallfree {
namespace testing {

// The launcher's environment (RANK, WORLD_SIZE, the store: CommOptions::FromEnvironment) as this
// rank's options, g_rank set from them; nullopt after printing "FAIL: <status>" to stderr.
std::optional<parallel::CommOptions> RankOptions();

// This rank's Gloo communicator over the launcher's whole group (RankOptions); null after
// printing "FAIL ..." to stderr.
std::unique_ptr<parallel::Communicator> JoinGlooGroup();

// What a rank's communicator counts for one kind of operation: calls, bytes sent, bytes received.
struct OpExpect {
  int64_t calls = 0, sent = 0, received = 0;
};
// The expected counters by kind; a kind not listed: no calls and no bytes.
using OpExpects = std::vector<std::pair<parallel::OpKind, OpExpect>>;

// A ring all-reduce of n floats over comm's group (parallel/gloo_communicator.cc's closed form):
// sent 4 (2n - blk(r) - blk(r+1)), received 4 (2n - blk(r-1) - blk(r)).
OpExpect AllReduceExpect(const parallel::Communicator& comm, int64_t n);

// The TP group's counters for one layer of the TP+SP and TP x CP blocks on Gloo's rings: 2
// all-gathers and 2 reduce-scatters of the activation, `bytes` sent and received by each kind
// (the two calls together); the backward also one all-reduce of the 2C LayerNorm gradients.
OpExpects TpLayerExpects(const parallel::Communicator& tp, int64_t bytes, bool backward, int64_t C);

// comm's counters against `want`, every kind counted or expected printed; false after printing
// the first mismatch.
bool CheckCounters(const parallel::Communicator& comm, const std::string& what,
                   const OpExpects& want);

// The block case of the TP+SP and TP x CP workers, for a batch of B rows of T tokens: C = 32,
// H = 4, FF = 64 (one layer); the same full weights (InitModelWeights, seed 1234, larger than the
// default init so that attention is far from uniform and every gradient is well above the
// tolerance floor), input x and output gradient dy (seeds 77 + T and 99 + T) on every rank; and
// the single-rank ReferenceBlock's forward and backward on the whole batch (positions 0..T-1).
struct TpBlockCase {
  parallel::ModelConfig model;  // vocab 1, 1 layer
  parallel::BlockConfig cfg;
  parallel::BlockWeights full;
  std::vector<float> x, dy;          // [B, T, C]
  std::vector<float> y_ref, dx_ref;  // the reference's output and input gradient
  parallel::BlockGrads g_ref;        // the reference's weight gradients
};

// *c for B x T; false after printing the failure (`at` names the case in it).
bool MakeTpBlockCase(int64_t B, int64_t T, const std::string& at, TpBlockCase* c);

// This rank's weight gradients g_shard (the TP shard `index` of `parts`, ShardTpspWeights'
// layout) against the reference's gradients sharded the same way: each tensor's size, then its
// values within the default tolerance of max |the whole reference tensor|. False after printing
// the first mismatch.
bool CompareTpShardGrads(const std::string& at, const TpBlockCase& c,
                         const parallel::BlockGrads& g_shard, int parts, int index);

}  // namespace testing
}  // namespace stallfree
