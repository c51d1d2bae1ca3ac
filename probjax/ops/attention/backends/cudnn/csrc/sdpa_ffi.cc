// cuDNN fused attention (cudnn-frontend SDPA graphs) as XLA FFI custom calls.
//
// Why not jax.nn's cuDNN custom call: XLA's runtime zeroes every output and the
// workspace of an fMHA custom call before each launch (ThunkEmitter sets
// should_memzero for them), 3 memsets per forward and 9 per forward+backward.
// Here cuDNN writes every output itself and the workspace comes from XLA's
// scratch allocator; cuDNN's frontend zeroes only the part of it that needs it.
//
// Layout: q/dq [B, Tq, H, D], o/do [B, Tq, H, Dv], k/dk [B, Tkv, Hkv, D], v/dv
// [B, Tkv, Hkv, Dv] (row-major; Dv, the values' head_dim, may differ from D), stats
// [B, H, Tq] float32 (cuDNN's natural-log softmax statistics), seq_q/seq_kv [B]
// int32 (read only with `padding`). 16-bit inputs only. Graphs are built once per shape/dtype/mask and
// device, and cached.
//
// cuDNN and the CUDA runtime are not linked: cudnn-frontend's dynamic loading finds
// them by soname in the process (libcudnn.so.9, libcudart.so.13; the Python side
// loads both from the nvidia packages first).

#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING

#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cudnn_frontend.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // set by the first Handle()
}  // namespace cudnn_frontend

namespace {

struct Shape {
  int64_t b, tq, h, tkv, hkv, d, dv;  // d: q/k head_dim; dv: v/o head_dim
};

struct Options {
  fe::DataType_t dtype;
  float scale;
  bool causal;
  int64_t left_bound;  // 0: none; else keys j > i - left_bound are kept
  bool padding;
  int64_t sdpa;   // cuDNN's SDPA lowering: 0 auto, 1 composite, 2 unified
  bool autotune;  // time every plan cuDNN's heuristics offer on the first call; else their first
};

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;
  TensorPtr q, k, v, o, stats, seq_q, seq_kv, d_o, dq, dk, dv;
  int64_t workspace = 0;
  bool tuned = false;
};

// q/o/do/dq (kv false) or k/v/dk/dv (kv true) of head_dim `width`: [B, T, H, width] memory seen
// as cuDNN's [B, H, T, width].
fe::graph::Tensor_attributes& Layout(fe::graph::Tensor_attributes& t, const Shape& s, bool kv, int64_t width) {
  const int64_t len = kv ? s.tkv : s.tq, h = kv ? s.hkv : s.h;
  return t.set_dim({s.b, h, len, width}).set_stride({len * h * width, width, h * width, 1});
}

// The softmax statistics: float32 [B, H, Tq, 1].
fe::graph::Tensor_attributes& StatsLayout(fe::graph::Tensor_attributes& t, const Shape& s) {
  return t.set_dim({s.b, s.h, s.tq, 1}).set_stride({s.h * s.tq, s.tq, 1, 1}).set_data_type(fe::DataType_t::FLOAT);
}

ffi::Error Check(fe::error_t e, const char* what) {
  if (e.is_bad()) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("probjax cuDNN SDPA: ") + what + ": " + e.get_message());
  }
  return ffi::Error::Success();
}

std::mutex& Lock() {
  static std::mutex m;
  return m;
}

ffi::ErrorOr<cudnnHandle_t> Handle(int device) {
  static std::map<int, cudnnHandle_t> handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  if (fe::cudnn_dlhandle == nullptr) {
    fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (fe::cudnn_dlhandle == nullptr) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        std::string("probjax cuDNN SDPA: cannot load libcudnn.so.9: ") + dlerror());
    }
  }
  cudnnHandle_t h;
  if (fe::detail::create_handle(&h) != CUDNN_STATUS_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kInternal, "probjax cuDNN SDPA: cudnnCreate failed");
  }
  handles[device] = h;
  return h;
}

TensorPtr Input(fe::graph::Graph& g, const char* name, const Shape& s, bool kv, int64_t width) {
  fe::graph::Tensor_attributes t;
  return g.tensor(Layout(t.set_name(name), s, kv, width));
}

TensorPtr Stats(fe::graph::Graph& g, const Shape& s) {
  fe::graph::Tensor_attributes t;
  return g.tensor(StatsLayout(t.set_name("stats"), s));
}

TensorPtr SeqLen(fe::graph::Graph& g, const char* name, int64_t b) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim({b, 1, 1, 1})
                      .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT32));
}

template <typename Attributes>
void SetMask(Attributes& a, Entry& e, fe::graph::Graph& g, const Shape& s, const Options& o) {
  a.set_attn_scale(o.scale);
  if (o.causal) a.set_causal_mask(true);
  if (o.left_bound > 0) a.set_diagonal_band_left_bound(static_cast<int>(o.left_bound));
  if (o.padding) {
    e.seq_q = SeqLen(g, "seq_q", s.b);
    e.seq_kv = SeqLen(g, "seq_kv", s.b);
    a.set_padding_mask(true).set_seq_len_q(e.seq_q).set_seq_len_kv(e.seq_kv);
  }
}

ffi::Error Build(Entry& e, cudnnHandle_t handle, bool all_plans) {
  auto& g = *e.graph;
  if (auto err = Check(g.validate(), "validate"); err.failure()) return err;
  if (auto err = Check(g.build_operation_graph(handle), "build_operation_graph"); err.failure()) return err;
  if (auto err = Check(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans"); err.failure())
    return err;
  if (auto err = Check(g.check_support(handle), "check_support"); err.failure()) return err;
  auto policy = all_plans ? fe::BuildPlanPolicy_t::ALL : fe::BuildPlanPolicy_t::HEURISTICS_CHOICE;
  if (auto err = Check(g.build_plans(handle, policy), "build_plans"); err.failure()) return err;
  e.workspace = all_plans ? g.get_autotune_workspace_size() : 0;
  if (all_plans) return ffi::Error::Success();
  return Check(g.get_workspace_size(e.workspace), "get_workspace_size");
}

std::shared_ptr<fe::graph::Graph> NewGraph(const Options& o) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(o.dtype)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, float, bool,
                       int64_t, bool, int64_t, bool>;

ffi::ErrorOr<Entry*> Get(int kind, const Shape& s, const Options& o, cudnnHandle_t handle, int device) {
  // kind: 0 inference forward, 1 training forward (stats), 2 backward
  static std::map<Key, std::unique_ptr<Entry>> cache;
  Key key{kind, device, s.b, s.tq, s.h, s.tkv, s.hkv, s.d, s.dv, static_cast<int>(o.dtype), o.scale, o.causal,
          o.left_bound, o.padding, o.sdpa, o.autotune};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second.get();
  auto e = std::make_unique<Entry>();
  e->graph = NewGraph(o);
  auto& g = *e->graph;
  e->q = Input(g, "q", s, false, s.d);
  e->k = Input(g, "k", s, true, s.d);
  e->v = Input(g, "v", s, true, s.dv);
  if (kind < 2) {
    auto a = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(kind == 1);
    const fe::AttentionImplementation_t impls[] = {fe::AttentionImplementation_t::AUTO,
                                                   fe::AttentionImplementation_t::COMPOSITE,
                                                   fe::AttentionImplementation_t::UNIFIED};
    a.set_implementation(impls[o.sdpa]);
    SetMask(a, *e, g, s, o);
    auto [out, stats] = g.sdpa(e->q, e->k, e->v, a);
    Layout(out->set_output(true), s, false, s.dv);
    e->o = out;
    if (kind == 1) {
      StatsLayout(stats->set_output(true), s);
      e->stats = stats;
    }
  } else {
    e->o = Input(g, "o", s, false, s.dv);
    e->d_o = Input(g, "do", s, false, s.dv);
    e->stats = Stats(g, s);
    auto a = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward");
    SetMask(a, *e, g, s, o);
    auto [dq, dk, dv] = g.sdpa_backward(e->q, e->k, e->v, e->o, e->d_o, e->stats, a);
    Layout(dq->set_output(true), s, false, s.d);
    Layout(dk->set_output(true), s, true, s.d);
    Layout(dv->set_output(true), s, true, s.dv);
    e->dq = dq;
    e->dk = dk;
    e->dv = dv;
  }
  if (auto err = Build(*e, handle, o.autotune); err.failure()) return err;
  Entry* ptr = e.get();
  cache.emplace(key, std::move(e));
  return ptr;
}

ffi::ErrorOr<fe::DataType_t> DataType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return fe::DataType_t::BFLOAT16;
    case ffi::DataType::F16: return fe::DataType_t::HALF;
    default: return ffi::Error::InvalidArgument("probjax cuDNN SDPA takes bfloat16 or float16");
  }
}

template <typename Dimensions>
std::string Dims(const Dimensions& d) {
  std::string out = "[";
  for (size_t i = 0; i < d.size(); ++i) out += (i ? ", " : "") + std::to_string(d[i]);
  return out + "]";
}

ffi::Error ShapeError(const std::string& what) {
  return ffi::Error::InvalidArgument("probjax cuDNN SDPA: " + what);
}

// The widest head_dim cuDNN's fused attention takes on sm_90, forward and backward, for q/k and
// v separately (multiples of 8); cuDNN's frontend validates the other architectures' limits.
constexpr int64_t kMaxHeadDim = 256;

// The call's shape from q [B, Tq, H, D], k [B, Tkv, Hkv, D] and v [B, Tkv, Hkv, Dv].
ffi::ErrorOr<Shape> ShapeOf(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ShapeError("q, k and v must be [batch, seq, heads, head_dim]; got q " + Dims(qd) + ", k " + Dims(kd) +
                      ", v " + Dims(vd));
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return ShapeError("k must match q in batch and head_dim; got q " + Dims(qd) + ", k " + Dims(kd));
  }
  if (vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
    return ShapeError("v must match k in [batch, kv_len, kv_heads]; got k " + Dims(kd) + ", v " + Dims(vd));
  }
  if (kd[2] <= 0 || qd[2] % kd[2] != 0) {
    return ShapeError("q's heads must be a multiple of k's; got q " + Dims(qd) + ", k " + Dims(kd));
  }
  for (auto [name, width] : {std::pair<const char*, int64_t>{"q/k head_dim", qd[3]}, {"value head_dim", vd[3]}}) {
    if (width <= 0 || width % 8 != 0 || width > kMaxHeadDim) {
      return ShapeError(std::string(name) + " " + std::to_string(width) + " is not a multiple of 8 up to " +
                        std::to_string(kMaxHeadDim));
    }
  }
  return Shape{qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], vd[3]};
}

// That `buffer` is [B, T, heads, width] of the query side (kv false) or the key side.
ffi::Error CheckLayout(const char* name, const ffi::AnyBuffer& buffer, const Shape& s, bool kv, int64_t width) {
  const std::vector<int64_t> want = {s.b, kv ? s.tkv : s.tq, kv ? s.hkv : s.h, width};
  auto got = buffer.dimensions();
  if (std::vector<int64_t>(got.begin(), got.end()) != want) {
    return ShapeError(std::string(name) + " must be " + Dims(want) + ", got " + Dims(got));
  }
  return ffi::Error::Success();
}

enum Slot { kQ, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// Runs one cached graph; `slots` gives the device pointer of each of its tensors (Slot order).
ffi::Error RunUnguarded(int kind, cudaStream_t stream, ffi::ScratchAllocator& scratch, const Shape& s, const Options& o,
               const ffi::AnyBuffer& seq_q, const ffi::AnyBuffer& seq_kv,
               const std::vector<std::pair<int, void*>>& slots) {
  int device = 0;
  if (fe::detail::cuda_get_device(&device) != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal, "probjax cuDNN SDPA: cudaGetDevice failed");
  }
  std::lock_guard<std::mutex> lock(Lock());
  auto handle = Handle(device);
  if (handle.has_error()) return handle.error();
  if (fe::detail::set_stream(handle.value(), stream) != CUDNN_STATUS_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kInternal, "probjax cuDNN SDPA: cudnnSetStream failed");
  }
  auto entry = Get(kind, s, o, handle.value(), device);
  if (entry.has_error()) return entry.error();
  Entry& e = *entry.value();
  TensorPtr named[] = {e.q, e.k, e.v, e.o, e.stats, e.d_o, e.dq, e.dk, e.dv};
  std::unordered_map<TensorPtr, void*> pack;
  for (auto& [slot, ptr] : slots) pack[named[slot]] = ptr;
  if (o.padding) {
    pack[e.seq_q] = seq_q.untyped_data();
    pack[e.seq_kv] = seq_kv.untyped_data();
  }
  if (kind == 2 && o.padding) {
    // cuDNN writes no gradient for keys past a batch element's length (nor for an element
    // without keys); zeros there, as XLA's memsets give jax.nn's call.
    const size_t q_bytes = 2 * s.b * s.tq * s.h * s.d, k_bytes = 2 * s.b * s.tkv * s.hkv * s.d,
                 v_bytes = 2 * s.b * s.tkv * s.hkv * s.dv;
    for (auto [slot, bytes] : {std::pair<int, size_t>{kDQ, q_bytes}, {kDK, k_bytes}, {kDV, v_bytes}}) {
      if (fe::detail::cuda_mem_set_async(pack[named[slot]], 0, bytes, stream) != cudaSuccess) {
        return ffi::Error(ffi::ErrorCode::kInternal, "probjax cuDNN SDPA: cudaMemsetAsync failed");
      }
    }
  }
  void* workspace = nullptr;
  if (e.workspace > 0) {
    // XLA takes alignments up to 16; its allocator's blocks are 256-byte aligned.
    auto mem = scratch.Allocate(static_cast<size_t>(e.workspace), 16);
    if (!mem.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, "probjax cuDNN SDPA: no scratch for the workspace");
    }
    workspace = mem.value();
  }
  if (!e.tuned && o.autotune) {  // synchronizes the device: once per graph
    if (auto err = Check(e.graph->autotune(handle.value(), pack, workspace), "autotune"); err.failure()) return err;
    e.tuned = true;
  }
  return Check(e.graph->execute(handle.value(), pack, workspace), "execute");
}

// cudnn-frontend throws where a library or symbol cannot be loaded.
ffi::Error Run(int kind, cudaStream_t stream, ffi::ScratchAllocator& scratch, const Shape& s, const Options& o,
               const ffi::AnyBuffer& seq_q, const ffi::AnyBuffer& seq_kv,
               const std::vector<std::pair<int, void*>>& slots) {
  try {
    return RunUnguarded(kind, stream, scratch, s, o, seq_q, seq_kv, slots);
  } catch (const std::exception& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("probjax cuDNN SDPA: ") + ex.what());
  }
}

// The custom calls' attributes, in the order PROBJAX_SDPA_ATTRS binds them.
#define PROBJAX_SDPA_ATTR_PARAMS \
  float scale, bool causal, int64_t left_bound, bool padding, int64_t sdpa, bool autotune
#define PROBJAX_SDPA_ATTR_ARGS scale, causal, left_bound, padding, sdpa, autotune

ffi::ErrorOr<Options> OptionsOf(ffi::DataType t, PROBJAX_SDPA_ATTR_PARAMS) {
  auto dtype = DataType(t);
  if (dtype.has_error()) return dtype.error();
  if (sdpa < 0 || sdpa > 2) return ffi::Error::InvalidArgument("probjax cuDNN SDPA: sdpa must be 0, 1 or 2");
  return Options{dtype.value(), PROBJAX_SDPA_ATTR_ARGS};
}

ffi::Error Forward(bool training, cudaStream_t stream, ffi::ScratchAllocator& scratch, const ffi::AnyBuffer& q,
                   const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const ffi::AnyBuffer& seq_q,
                   const ffi::AnyBuffer& seq_kv, ffi::AnyBuffer& o, void* stats, PROBJAX_SDPA_ATTR_PARAMS) {
  auto s = ShapeOf(q, k, v);
  if (s.has_error()) return s.error();
  if (auto err = CheckLayout("o", o, s.value(), false, s.value().dv); err.failure()) return err;
  auto opts = OptionsOf(q.element_type(), PROBJAX_SDPA_ATTR_ARGS);
  if (opts.has_error()) return opts.error();
  std::vector<std::pair<int, void*>> slots = {
      {kQ, q.untyped_data()}, {kK, k.untyped_data()}, {kV, v.untyped_data()}, {kO, o.untyped_data()}};
  if (training) slots.push_back({kStats, stats});
  return Run(training ? 1 : 0, stream, scratch, s.value(), opts.value(), seq_q, seq_kv, slots);
}

ffi::Error ForwardImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::AnyBuffer seq_q, ffi::AnyBuffer seq_kv, ffi::Result<ffi::AnyBuffer> o,
                       PROBJAX_SDPA_ATTR_PARAMS) {
  return Forward(false, stream, scratch, q, k, v, seq_q, seq_kv, *o, nullptr,
                 PROBJAX_SDPA_ATTR_ARGS);
}

ffi::Error ForwardStatsImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                            ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer seq_q, ffi::AnyBuffer seq_kv,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> stats,
                            PROBJAX_SDPA_ATTR_PARAMS) {
  return Forward(true, stream, scratch, q, k, v, seq_q, seq_kv, *o, stats->untyped_data(),
                 PROBJAX_SDPA_ATTR_ARGS);
}

ffi::Error BackwardImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer d_o, ffi::AnyBuffer stats,
                        ffi::AnyBuffer seq_q, ffi::AnyBuffer seq_kv, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, PROBJAX_SDPA_ATTR_PARAMS) {
  auto s = ShapeOf(q, k, v);
  if (s.has_error()) return s.error();
  const Shape& sv = s.value();
  const std::tuple<const char*, const ffi::AnyBuffer*, bool, int64_t> layouts[] = {
      {"o", &o, false, sv.dv}, {"do", &d_o, false, sv.dv}, {"dq", &*dq, false, sv.d},
      {"dk", &*dk, true, sv.d}, {"dv", &*dv, true, sv.dv}};
  for (auto [name, buffer, kv, width] : layouts) {
    if (auto err = CheckLayout(name, *buffer, sv, kv, width); err.failure()) return err;
  }
  auto opts = OptionsOf(q.element_type(), PROBJAX_SDPA_ATTR_ARGS);
  if (opts.has_error()) return opts.error();
  std::vector<std::pair<int, void*>> slots = {
      {kQ, q.untyped_data()},    {kK, k.untyped_data()},    {kV, v.untyped_data()},
      {kO, o.untyped_data()},    {kDO, d_o.untyped_data()}, {kStats, stats.untyped_data()},
      {kDQ, dq->untyped_data()}, {kDK, dk->untyped_data()}, {kDV, dv->untyped_data()}};
  return Run(2, stream, scratch, s.value(), opts.value(), seq_q, seq_kv, slots);
}

}  // namespace

// Bindings: the stream and scratch allocator, buffer arguments, buffer results, attributes.
#define PROBJAX_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>()
#define PROBJAX_ARG .Arg<ffi::AnyBuffer>()
#define PROBJAX_RET .Ret<ffi::AnyBuffer>()
#define PROBJAX_SDPA_ATTRS                                                                    \
  .Attr<float>("scale").Attr<bool>("causal").Attr<int64_t>("left_bound").Attr<bool>("padding") \
      .Attr<int64_t>("sdpa").Attr<bool>("autotune")

// q, k, v, seq_q, seq_kv -> o
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbjaxCudnnSdpaForward, ForwardImpl,
                              PROBJAX_BIND PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG
                                  PROBJAX_RET PROBJAX_SDPA_ATTRS);
// q, k, v, seq_q, seq_kv -> o, stats
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbjaxCudnnSdpaForwardStats, ForwardStatsImpl,
                              PROBJAX_BIND PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG
                                  PROBJAX_RET PROBJAX_RET PROBJAX_SDPA_ATTRS);
// q, k, v, o, do, stats, seq_q, seq_kv -> dq, dk, dv
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbjaxCudnnSdpaBackward, BackwardImpl,
                              PROBJAX_BIND PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG
                                  PROBJAX_ARG PROBJAX_ARG PROBJAX_ARG PROBJAX_RET PROBJAX_RET PROBJAX_RET
                                      PROBJAX_SDPA_ATTRS);
