#include "trainer/init_dump.h"

#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/status.h"

namespace stallfree {
namespace trainer {
namespace {

void AppendLe32(std::string* out, uint32_t x) {
  const char b[4] = {static_cast<char>(x & 0xff), static_cast<char>((x >> 8) & 0xff),
                     static_cast<char>((x >> 16) & 0xff), static_cast<char>(x >> 24)};
  out->append(b, 4);
}

std::string LittleEndian(const std::vector<float>& v) {
  std::string out;
  out.reserve(v.size() * 4);
  for (float x : v) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    AppendLe32(&out, bits);
  }
  return out;
}

std::string LittleEndian(const std::vector<int32_t>& v) {
  std::string out;
  out.reserve(v.size() * 4);
  for (int32_t x : v) AppendLe32(&out, static_cast<uint32_t>(x));
  return out;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\')
      absl::StrAppend(&out, "\\", std::string(1, c));
    else if (c < 0x20)
      absl::StrAppend(&out, absl::StrFormat("\\u%04x", c));
    else
      out += static_cast<char>(c);
  }
  return out + "\"";
}

template <class T>
std::string JsonList(const std::vector<T>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_floating_point_v<T>) {
      absl::StrAppend(&out, i > 0 ? ", " : "", absl::StrFormat("%.17g", v[i]));
    } else {
      absl::StrAppend(&out, i > 0 ? ", " : "", v[i]);
    }
  }
  return out + "]";
}

}  // namespace

absl::Status WriteInitDump(const TrainOptions& o, const parallel::ModelConfig& cfg, int64_t B,
                           int64_t T, const Corpus& corpus, const std::vector<Tensor>& tensors,
                           const RankDevice& dev, const DumpedBatches& batches,
                           const std::vector<double>& lrs, const std::vector<int64_t>& eval_steps) {
  RETURN_IF_ERROR(MakeDirs(o.dump_init));
  const std::string dir = o.dump_init + "/";
  std::string list;
  for (const Tensor& t : tensors) {
    std::vector<float> host(t.numel);
    dev.ops().Download(host.data(), t.value, t.numel);
    RETURN_IF_ERROR(dev.Synchronize());
    const std::string file = t.name + ".f32";
    RETURN_IF_ERROR(WriteFileAtomically(dir + file, LittleEndian(host)));
    absl::StrAppend(&list, list.empty() ? "" : ",\n", "    {\"name\": ", JsonString(t.name),
                    ", \"shape\": ", JsonList(t.shape), ", \"file\": ", JsonString(file), "}");
  }
  const int64_t eval_n = static_cast<int64_t>(batches.eval_tokens.size()) / (B * T);
  std::string batch_list;
  for (const auto& [name, data, n] :
       {std::make_tuple("tokens", &batches.tokens, o.steps),
        std::make_tuple("targets", &batches.targets, o.steps),
        std::make_tuple("eval_tokens", &batches.eval_tokens, eval_n),
        std::make_tuple("eval_targets", &batches.eval_targets, eval_n)}) {
    const std::string file = absl::StrCat(name, ".i32");
    RETURN_IF_ERROR(WriteFileAtomically(dir + file, LittleEndian(*data)));
    absl::StrAppend(&batch_list, batch_list.empty() ? "" : ",\n", "    \"", name,
                    "\": {\"file\": ", JsonString(file),
                    ", \"shape\": ", JsonList<int64_t>({n, B, T}), ", \"dtype\": \"int32\"}");
  }
  const ZenFlowConfig& e = o.engine;
  std::string manifest = absl::StrCat(
      "{\n  \"format\": \"stallfree-trainer-init/1\",\n",
      absl::StrFormat("  \"model\": {\"layers\": %d, \"d_model\": %d, \"heads\": %d, \"d_ff\": %d, "
                      "\"vocab\": %d, \"seq_len\": %d, \"max_seq\": %d, \"positions\": \"%s\", "
                      "\"tied_head\": %s, \"norm_eps\": %.17g},\n",
                      cfg.layers, cfg.C, cfg.H, cfg.FF, cfg.vocab, T, cfg.max_seq,
                      cfg.learned_positions ? "learned" : "none", cfg.tied_head ? "true" : "false",
                      static_cast<double>(cfg.eps)),
      absl::StrFormat("  \"optimizer\": {\"mode\": \"%s\", \"lr\": %.17g, \"lr_warmup\": %d, "
                      "\"min_lr_ratio\": %.17g, \"steps\": %d, \"clip\": %.17g, "
                      "\"weight_decay\": %.17g, \"beta1\": %.17g, \"beta2\": %.17g, "
                      "\"eps\": %.17g,\n    \"lr_per_step\": ",
                      OffloadModeName(e.mode), o.lr, o.lr_warmup, o.min_lr_ratio, o.steps, o.clip,
                      e.weight_decay, e.beta1, e.beta2, e.eps),
      JsonList(lrs), "},\n",
      absl::StrFormat("  \"data\": {\"source\": %s, \"batch\": %d, \"seed\": %d, "
                      "\"train_tokens\": %d, \"eval_tokens\": %d, \"eval_every\": %d, "
                      "\"eval_batches\": %d, \"eval_steps\": ",
                      JsonString(corpus.source), B, o.seed, corpus.train.size(), corpus.eval.size(),
                      o.eval_every, eval_n),
      JsonList(eval_steps), "},\n  \"tensors\": [\n", list, "\n  ],\n  \"batches\": {\n",
      batch_list, "\n  }\n}\n");
  return WriteFileAtomically(dir + "manifest.json", manifest);
}

}  // namespace trainer
}  // namespace stallfree
