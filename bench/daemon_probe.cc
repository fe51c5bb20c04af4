// daemon_probe: times the daemon's own work (whole-slot bf16 pushes and column-step Updates with
// bf16 out, as the ZenFlow engine drives them) on a SessionManager in this process, with the
// minor page faults of each phase. Not a user tool; a measurement aid for server/ changes.
//
//   bazel run -c opt //bench:daemon_probe -- [elements_scale] [rounds] [reserved_master_slots: 1 = the old daemon arena]
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include "common/region.h"
#include "server/session_manager.h"

using namespace stallfree;
using Clock = std::chrono::steady_clock;

static double Cpu() {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}
static double c0;
static long Faults() {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt + u.ru_majflt;
}

struct Waitable {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status st;
  void Set(absl::Status s) {
    std::lock_guard<std::mutex> l(mu);
    st = s;
    done = true;
    cv.notify_all();
  }
  absl::Status Wait() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
    return st;
  }
};

// Seconds since t.
static double Secs(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The registration of `blocks` transformer blocks plus embedding and head, bf16 gradients.
static v1::RegisterParamsRequest ModelParams(const v1::SessionRef& ref, int blocks) {
  v1::RegisterParamsRequest reg;
  *reg.mutable_session() = ref;
  auto add = [&](const char* name, int64_t r, int64_t c) {
    v1::ParamSpec* p = reg.add_params();
    p->set_name(name + std::to_string(reg.params_size()));
    p->add_shape(r);
    p->add_shape(c);
    p->set_grad_dtype(v1::DTYPE_BF16);
  };
  for (int b = 0; b < blocks; ++b) {
    for (int i = 0; i < 4; ++i) add("attn", 1024, 922);
    add("gate", 2816, 922);
    add("up", 2816, 922);
    add("down", 1024, 2534);
  }
  add("emb", 32000, 922);
  add("head", 32000, 922);
  return reg;
}

// One whole-slot push (round r, push k), timed and printed; false (said on stderr) if it failed.
static bool TimedPush(SessionManager& sm, const v1::SessionRef& ref, int r, int k) {
  v1::PushGradientsRequest p;
  *p.mutable_session() = ref;
  p.set_slot(k & 1);
  p.set_scale(0.25f);
  v1::PushGradientsResponse presp;
  Waitable w;
  const long f0 = Faults();
  c0 = Cpu();
  const auto t0 = Clock::now();
  sm.PushGradients(p, &presp, [&](absl::Status s) { w.Set(s); });
  absl::Status st = w.Wait();
  if (!st.ok()) return fprintf(stderr, "%s\n", st.ToString().c_str()), false;
  printf("round %d push %d: %7.1f ms, cpu %7.1f ms, %ld faults\n", r, k, 1e3 * Secs(t0),
         1e3 * (Cpu() - c0), Faults() - f0);
  return true;
}

// One column-step Update with bf16 out (round r, version step) and its wait, timed and printed;
// false (said on stderr) if it failed.
static bool TimedUpdate(SessionManager& sm, const v1::SessionRef& ref, int r, int64_t step) {
  v1::UpdateRequest u;
  *u.mutable_session() = ref;
  u.set_step(step);
  u.mutable_hyper()->set_lr(1e-4);
  u.mutable_hyper()->set_beta1(0.9);
  u.mutable_hyper()->set_beta2(0.95);
  u.mutable_hyper()->set_eps(1e-8);
  u.mutable_hyper()->set_weight_decay(0.01);
  u.set_param_slot(step & 1);
  u.set_out_dtype(v1::DTYPE_BF16);
  u.set_column_steps(true);
  const long f0 = Faults();
  c0 = Cpu();
  const auto t0 = Clock::now();
  absl::Status st = sm.Update(u);
  if (!st.ok()) return fprintf(stderr, "%s\n", st.ToString().c_str()), false;
  v1::WaitUpdateRequest wr;
  *wr.mutable_session() = ref;
  wr.set_min_version(step);
  std::mutex mu;
  std::condition_variable cv;
  bool got = false;
  double useconds = 0;
  sm.WaitUpdate(wr, [&](absl::StatusOr<WaitResult> res) {
    std::lock_guard<std::mutex> l(mu);
    useconds = res.ok() ? res->update_seconds : -1;
    got = true;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return got; });
  }
  printf("round %d update: %7.1f ms (daemon %7.1f ms), cpu %7.1f ms, %ld faults\n", r,
         1e3 * Secs(t0), 1e3 * useconds, 1e3 * (Cpu() - c0), Faults() - f0);
  return true;
}

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? atoi(argv[1]) : 12;
  const int rounds = argc > 2 ? atoi(argv[2]) : 3;
  const int reserved = argc > 3 ? atoi(argv[3]) : 1;
  DaemonOptions opts;
  opts.pin = PinPolicy::kOff;
  opts.worker_threads = tbb::this_task_arena::max_concurrency();
  tbb::global_control workers(tbb::global_control::max_allowed_parallelism,
                              static_cast<size_t>(opts.worker_threads) + (reserved == 0 ? 1 : 0));
  tbb::task_arena arena(opts.worker_threads, reserved);
  SessionManager sm(opts, &arena);
  v1::OpenSessionRequest oreq;
  oreq.set_name("probe");
  oreq.set_pid(getpid());
  auto open = sm.Open(oreq);
  if (!open.ok()) return fprintf(stderr, "%s\n", open.status().ToString().c_str()), 1;
  const v1::SessionRef ref = open->session();
  const v1::RegisterParamsRequest reg = ModelParams(ref, blocks);
  v1::RegisterParamsResponse rresp;
  const long f0 = Faults();
  const auto t0 = Clock::now();
  {
    Waitable w;
    sm.RegisterParams(reg, &rresp, [&](absl::Status s) { w.Set(s); });
    absl::Status st = w.Wait();
    if (!st.ok()) return fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
  }
  int64_t elems = 0;
  for (const auto& p : rresp.layout().params()) elems += p.numel();
  printf("register: %lld elements, %.3f s, %ld faults\n", (long long)elems, Secs(t0),
         Faults() - f0);
  auto att = sm.Attach(ref.session_id(), ref.token(), getuid(), getpid());
  if (!att.ok()) return fprintf(stderr, "%s\n", att.status().ToString().c_str()), 1;
  auto region = MappedRegion::MapFd(dup(att->region_fd), att->region_bytes);
  if (!region.ok()) return fprintf(stderr, "%s\n", region.status().ToString().c_str()), 1;
  {  // Both gradient slots: small bf16 values (as the bench fills them once).
    uint16_t* g = reinterpret_cast<uint16_t*>((*region)->data());
    const uint64_t n = 2 * rresp.layout().grad_slot_bytes() / 2;
    for (uint64_t i = 0; i < n; ++i)
      g[i] = static_cast<uint16_t>(0x3c00 + (i * 2654435761u >> 20) % 256);
  }
  int64_t step = 0;
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 4; ++k) {
      if (!TimedPush(sm, ref, r, k)) return 1;
    }
    if (!TimedUpdate(sm, ref, r, ++step)) return 1;
  }
  v1::Stats stats = sm.GetStats();
  printf("stats: pushes %lld accumulate_seconds %.3f updates %lld update_seconds %.3f\n",
         (long long)stats.pushes(), stats.accumulate_seconds(), (long long)stats.updates(),
         stats.update_seconds());
  v1::CloseSessionRequest close;
  *close.mutable_session() = ref;
  (void)sm.Close(close);
  sm.Drain();
  fflush(stdout);
  _exit(0);  // the arena's workers may still hold the closed session's last task
}
