// The one-GPU group (device prepare + permute kernels) against the host reference group of one
// rank, on the same inputs. Bit-exact: the layout, every dispatched byte, combine and
// dispatch_backward (same fp32 fma/add order per element), d_y of combine_backward (one fp32
// multiply, one rounding) and the weight gradients copied back. With a tolerance: d_row_weights
// (a warp reduction instead of the reference's sequential sum).
// Both dispatch kernels (warp and bulk) are run directly as well, with few CTAs (every warp walks
// many tokens) and with misaligned buffers. Quantize on the way: the fused kernel against quantize
// followed by the quantized dispatch on the GPU, and against the CPU reference, bit for bit, on
// random and adversarial routing and on rows of zeros, extremes, infinities and NaNs; every output
// buffer is poisoned with a different byte per run, so a byte left unwritten cannot pass.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "common/routing_draw.h"
#include "core/ep_state.h"
#include "cuda/permute/permute.h"
#include "epx/comm.h"
#include "epx/error.h"
#include "epx/layout.h"
#include "epx/quant.h"
#include "gpu/gpu_test_util.h"

namespace epx {
namespace {

using testing::all_close;
using testing::bit_equal;
using testing::draw_routing;
using testing::RoutingDraw;
using testing::to_gpu;
using testing::to_host;

struct Case {
  int T = 64, E = 16, K = 4, H = 96, align = 1, max_tokens = 64;
  DType payload = DType::kBF16;
  DType idx_dtype = DType::kI32;
  float capacity = 0;
  DropPolicy drop = DropPolicy::kByPosition;
  int hot = -1;         // every token's first slot to this expert
  double mask_p = 0.1;  // chance a slot is masked
  double zipf = 0;      // skew of the expert choice
  uint32_t seed = 1;
};

std::string describe(const Case& c) {
  return detail::concat("T=", c.T, " E=", c.E, " K=", c.K, " H=", c.H, " align=", c.align, " payload=",
                        dtype_name(c.payload), " idx=", dtype_name(c.idx_dtype), " cf=", c.capacity, " drop=",
                        static_cast<int>(c.drop), " hot=", c.hot, " zipf=", c.zipf, " seed=", c.seed);
}

GroupConfig config_of(const Case& c) {
  GroupConfig g;
  g.num_experts = c.E;
  g.hidden = c.H;
  g.max_tokens_per_rank = c.max_tokens;
  g.max_topk = c.K;
  g.max_dtype = DType::kF32;
  g.align = c.align;
  return g;
}

struct Inputs {
  Tensor idx, w, x, y, d_out, d_recv, d_recv_w;
};

Inputs make_inputs(const Case& c, int64_t cap) {
  std::mt19937 rng(c.seed);
  std::uniform_real_distribution<double> u(0, 1);
  std::normal_distribution<float> n(0, 1);
  Inputs in;
  in.idx = Tensor::empty({c.T, c.K}, c.idx_dtype);
  draw_routing(rng, u, c.T, RoutingDraw{c.E, c.K, c.hot, c.mask_p, c.zipf}, [&](int t, int k, int64_t e) {
    store_from_double(in.idx.data(), c.idx_dtype, t * c.K + k, static_cast<double>(e));
  });
  in.w = Tensor::empty({c.T, c.K}, DType::kF32);
  for (int64_t i = 0; i < in.w.numel(); ++i) in.w.ptr<float>()[i] = static_cast<float>(0.05 + u(rng));
  auto rows = [&](int64_t r) {
    Tensor t = Tensor::empty({r, c.H}, c.payload);
    for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), c.payload, i, n(rng));
    return t;
  };
  in.x = rows(c.T);
  in.y = rows(cap);
  in.d_out = rows(c.T);
  in.d_recv = rows(cap);
  in.d_recv_w = Tensor::empty({cap}, DType::kF32);
  for (int64_t i = 0; i < cap; ++i) in.d_recv_w.ptr<float>()[i] = n(rng);
  return in;
}

struct Outputs {
  std::vector<int32_t> offsets, routed;
  Tensor recv_x, recv_w, out, d_y, d_row_w, d_x, d_topk_w;
};

Outputs run_all(Group& g, const Case& c, const Inputs& in, bool on_gpu) {
  const int64_t cap = g.recv_capacity_rows();
  auto dev = [&](const Tensor& t) { return on_gpu ? to_gpu(t) : t.clone(); };
  auto poisoned = [&](Shape s, DType dt) {
    Tensor h = Tensor::full(s, dt, 1234.5);
    return on_gpu ? to_gpu(h) : h;
  };
  Tensor idx = dev(in.idx), w = dev(in.w), x = dev(in.x), y = dev(in.y), d_out = dev(in.d_out), d_recv = dev(in.d_recv),
         d_recv_w = dev(in.d_recv_w);
  Outputs o;
  o.recv_x = poisoned({cap, c.H}, c.payload);
  o.recv_w = poisoned({cap}, DType::kF32);
  o.out = poisoned({c.T, c.H}, c.payload);
  o.d_y = poisoned({cap, c.H}, c.payload);
  o.d_row_w = poisoned({cap}, DType::kF32);
  o.d_x = poisoned({c.T, c.H}, c.payload);
  o.d_topk_w = poisoned({c.T, c.K}, DType::kF32);
  PrepareOptions opt;
  opt.capacity_factor = c.capacity;
  opt.drop_policy = c.drop;
  Handle h = prepare(g, idx, w, opt);
  dispatch_forward(g, h, x, w, o.recv_x, o.recv_w);
  combine_forward(g, h, y, o.recv_w, o.out);
  combine_backward(g, h, d_out, y, o.recv_w, o.d_y, o.d_row_w);
  dispatch_backward(g, h, d_recv, d_recv_w, o.d_x, o.d_topk_w);
  g.check();
  o.offsets = h.expert_offsets_host();
  Tensor r = to_host(h.routed_experts());
  o.routed.assign(r.ptr<int32_t>(), r.ptr<int32_t>() + r.numel());
  return o;
}

// Rows [0, used) of a [cap, ...] tensor.
Tensor used_rows(const Tensor& t, int64_t used) { return to_host(t.ref().slice_rows(0, used)); }

void compare(const Case& c) {
  SCOPED_TRACE(describe(c));
  auto host = Group::create_simulated(1, config_of(c));
  Group gpu = Group::create_local(config_of(c), 0);
  ASSERT_EQ(host[0].recv_capacity_rows(), gpu.recv_capacity_rows());
  const Inputs in = make_inputs(c, gpu.recv_capacity_rows());
  const Outputs want = run_all(host[0], c, in, false);
  const Outputs got = run_all(gpu, c, in, true);
  ASSERT_EQ(got.routed, want.routed) << "kept routing";
  ASSERT_EQ(got.offsets, want.offsets) << "expert offsets";
  const int64_t used = want.offsets.back();
  EXPECT_TRUE(bit_equal(used_rows(got.recv_x, used), used_rows(want.recv_x, used))) << "recv_x";
  EXPECT_TRUE(bit_equal(used_rows(got.recv_w, used), used_rows(want.recv_w, used))) << "recv_weights";
  EXPECT_TRUE(bit_equal(got.out, want.out)) << "combine out";
  EXPECT_TRUE(bit_equal(used_rows(got.d_y, used), used_rows(want.d_y, used))) << "combine_backward d_y";
  EXPECT_TRUE(all_close(used_rows(got.d_row_w, used), used_rows(want.d_row_w, used), 1e-4, 1e-4)) << "d_row_weights";
  EXPECT_TRUE(bit_equal(got.d_x, want.d_x)) << "dispatch_backward d_x";
  EXPECT_TRUE(bit_equal(got.d_topk_w, want.d_topk_w)) << "dispatch_backward d_topk_weights";
}

TEST(EpLocalGpu, MatchesReferenceOnRandomRouting) {
  EPX_REQUIRE_GPU();
  for (uint32_t seed : {1u, 2u, 3u}) {
    Case c;
    c.seed = seed;
    compare(c);
  }
}

TEST(EpLocalGpu, AdversarialRouting) {
  EPX_REQUIRE_GPU();
  Case hot;
  hot.hot = 5;
  hot.mask_p = 1.0;  // every token to expert 5 only
  compare(hot);
  Case skew;
  skew.zipf = 4;  // most pairs on the first experts, many experts empty
  compare(skew);
  Case masked;
  masked.mask_p = 0.7;
  compare(masked);
  Case all_masked;
  all_masked.mask_p = 1.0;
  compare(all_masked);
}

TEST(EpLocalGpu, ShapesAlignmentsAndDtypes) {
  EPX_REQUIRE_GPU();
  for (int align : {1, 16, 128}) {
    Case c;
    c.align = align;
    c.seed = 10 + align;
    compare(c);
  }
  for (DType p : {DType::kF32, DType::kF16}) {
    Case c;
    c.payload = p;
    c.idx_dtype = DType::kI64;
    compare(c);
  }
  Case odd;  // rows not a multiple of 16 bytes: the scalar path
  odd.H = 7;
  compare(odd);
  Case zero;
  zero.T = 0;
  compare(zero);
  Case full;  // T = max, large: several layout blocks, many rounds
  full.T = full.max_tokens = 3000;
  full.E = 256;
  full.K = 8;
  full.H = 64;
  compare(full);
  Case k1;
  k1.K = 1;
  compare(k1);
}

TEST(EpLocalGpu, CapacityDropping) {
  EPX_REQUIRE_GPU();
  for (DropPolicy d : {DropPolicy::kByPosition, DropPolicy::kByProbability})
    for (float cf : {0.5f, 1.0f}) {
      Case c;
      c.zipf = 2;
      c.capacity = cf;
      c.drop = d;
      c.T = c.max_tokens = 500;
      compare(c);
    }
}

TEST(EpLocalGpu, QuantizedDispatchMatchesReference) {
  EPX_REQUIRE_GPU();
  Case c;
  c.H = 256;
  auto host = Group::create_simulated(1, config_of(c));
  Group gpu = Group::create_local(config_of(c), 0);
  const Inputs in = make_inputs(c, gpu.recv_capacity_rows());
  const int64_t cap = gpu.recv_capacity_rows();
  Tensor q = Tensor::empty({c.T, c.H}, DType::kF8E4M3), s = Tensor::empty({c.T, 2}, DType::kF32);
  for (int64_t i = 0; i < q.numel(); ++i) static_cast<uint8_t*>(q.data())[i] = static_cast<uint8_t>((i * 37) % 126);
  for (int64_t i = 0; i < s.numel(); ++i) s.ptr<float>()[i] = 0.5f + i;
  std::vector<Tensor> rq(2), rs(2);
  std::vector<int32_t> offsets;
  for (int side = 0; side < 2; ++side) {
    Group& g = side ? gpu : host[0];
    auto dev = [&](const Tensor& t) { return side ? to_gpu(t) : t.clone(); };
    rq[side] = dev(Tensor::full({cap, c.H}, DType::kF8E4M3, 3.0));
    rs[side] = dev(Tensor::full({cap, 2}, DType::kF32, 7.0));
    Handle h = prepare(g, dev(in.idx), {});
    dispatch_forward(g, h, dev(q), dev(s), {}, rq[side], rs[side], {});
    g.check();
    offsets = h.expert_offsets_host();
  }
  const int64_t used = offsets.back();
  EXPECT_TRUE(bit_equal(to_host(rq[1]).ref().slice_rows(0, used), to_host(rq[0]).ref().slice_rows(0, used)));
  EXPECT_TRUE(bit_equal(to_host(rs[1]).ref().slice_rows(0, used), to_host(rs[0]).ref().slice_rows(0, used)));
}

TEST(EpLocalGpu, BadIdsAreMaskedAndReportedByCheck) {
  EPX_REQUIRE_GPU();
  Case c;
  Group g = Group::create_local(config_of(c), 0);
  Inputs in = make_inputs(c, g.recv_capacity_rows());
  store_from_double(in.idx.data(), c.idx_dtype, 5 * c.K + 2, 99.0);  // token 5, slot 2: E = 16
  Handle h = prepare(g, to_gpu(in.idx), {});
  Tensor routed = to_host(h.routed_experts());
  EXPECT_EQ(routed.ptr<int32_t>()[5 * c.K + 2], -1) << "a bad slot is masked, never used as an index";
  try {
    g.check();
    FAIL() << "check() must report the bad id";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx[5, 2] is 99, expected -1 (masked) or an expert id in [0, 16)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(g.check()) << "an error is reported once";
}

// After a dispatch that overflowed its recv capacity: check() raises kCapacityExceeded with
// `message` in its text, and recv (filled with 3 before) was not written.
void expect_overflow_reported(Group& g, const Tensor& recv, const std::string& message) {
  try {
    g.check();
    ADD_FAILURE() << "check() must report the overflow";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kCapacityExceeded);
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
  Tensor back = to_host(recv);
  for (int64_t i = 0; i < back.numel(); ++i) ASSERT_EQ(back.item(i), 3.0) << "overflowing dispatch wrote element " << i;
}

TEST(EpLocalGpu, RecvOverflowWritesNothingAndIsReported) {
  EPX_REQUIRE_GPU();
  Case c;
  c.hot = 3;
  c.mask_p = 1.0;
  GroupConfig cfg = config_of(c);
  cfg.recv_capacity_rows = 10;  // 64 rows would be needed
  Group g = Group::create_local(cfg, 0);
  Inputs in = make_inputs(c, 10);
  Tensor recv = to_gpu(Tensor::full({10, c.H}, c.payload, 3.0));
  Handle h = prepare(g, to_gpu(in.idx), {});
  dispatch_forward(g, h, to_gpu(in.x), {}, recv, {});
  expect_overflow_reported(g, recv, "would receive 64 expert-major rows, more than the group's recv capacity of 10");
}

// The same overflow against a handle's own capacity (PrepareOptions::recv_capacity_rows, the group's
// being the worst case): nothing written, reported as the handle's. The same handle capacity
// with room enough gives the group-capacity dispatch's rows.
TEST(EpLocalGpu, HandleRecvCapacityOverflowWritesNothingAndIsReported) {
  EPX_REQUIRE_GPU();
  Case c;
  c.hot = 3;
  c.mask_p = 1.0;
  Group g = Group::create_local(config_of(c), 0);
  Inputs in = make_inputs(c, 10);
  Tensor recv = to_gpu(Tensor::full({10, c.H}, c.payload, 3.0));
  PrepareOptions po;
  po.recv_capacity_rows = 10;  // 64 rows would be needed
  Handle h = prepare(g, to_gpu(in.idx), {}, po);
  dispatch_forward(g, h, to_gpu(in.x), {}, recv, {});
  expect_overflow_reported(g, recv, "would receive 54 expert-major rows more than the recv capacity of a handle");
  EXPECT_NO_THROW(g.check()) << "an error is reported once";

  po.recv_capacity_rows = 64;
  Handle fits = prepare(g, to_gpu(in.idx), {}, po), full = prepare(g, to_gpu(in.idx), {});
  ASSERT_LT(64, g.recv_capacity_rows());
  Tensor r64 = to_gpu(Tensor::zeros({64, c.H}, c.payload));
  Tensor rfull = to_gpu(Tensor::zeros({g.recv_capacity_rows(), c.H}, c.payload));
  dispatch_forward(g, fits, to_gpu(in.x), {}, r64, {});
  dispatch_forward(g, full, to_gpu(in.x), {}, rfull, {});
  g.check();
  EXPECT_TRUE(testing::bit_equal(to_host(r64), to_host(rfull).ref().slice_rows(0, 64)));
}

TEST(EpLocalGpu, GraphReplayIsBitIdenticalToEager) {
  EPX_REQUIRE_GPU();
  Case c;
  c.T = c.max_tokens = 256;
  c.E = 32;
  c.K = 8;
  c.H = 128;
  Group g = Group::create_local(config_of(c), 0);
  const Inputs in = make_inputs(c, g.recv_capacity_rows());
  const int64_t cap = g.recv_capacity_rows();
  Tensor idx = to_gpu(in.idx), w = to_gpu(in.w), x = to_gpu(in.x);
  Tensor recv = to_gpu(Tensor::zeros({cap, c.H}, c.payload)), rw = to_gpu(Tensor::zeros({cap}, DType::kF32));
  Tensor out_eager = to_gpu(Tensor::zeros({c.T, c.H}, c.payload)), out_graph = to_gpu(Tensor::zeros({c.T, c.H}, c.payload));
  auto step = [&](const Tensor& out, Stream s) {
    Handle h = prepare(g, idx, w, {}, s);
    dispatch_forward(g, h, x, w, recv, rw, s);
    combine_forward(g, h, recv, rw, out, s);
  };
  step(out_eager, {});
  g.check();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  step(out_graph, Stream{stream});
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 10; ++i) {
    ASSERT_EQ(cudaMemsetAsync(out_graph.data(), 0, out_graph.nbytes(), stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_TRUE(bit_equal(out_graph, out_eager)) << "replay " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---- both dispatch kernels, run directly ------------------------------------------------------

// A device buffer of `bytes` + 64 whose view starts `offset` bytes in: misaligned on purpose.
struct OffsetBuffer {
  Tensor storage;
  TensorRef view;
};

OffsetBuffer offset_buffer(Shape shape, DType dt, int offset, int poison) {
  int64_t n = 1;
  for (int d = 0; d < shape.ndim(); ++d) n *= shape[d];
  OffsetBuffer b;
  b.storage = Tensor::empty({n * static_cast<int64_t>(dtype_size(dt)) + 64}, DType::kU8, Device::cuda(0));
  detail::memset_bytes(b.storage.data(), b.storage.device(), poison, b.storage.nbytes());
  b.view = TensorRef(static_cast<char*>(b.storage.data()) + offset, dt, shape, Device::cuda(0));
  return b;
}

OffsetBuffer offset_copy(const Tensor& host, int offset) {
  OffsetBuffer b = offset_buffer(host.shape(), host.dtype(), offset, 0);
  copy(host, b.view);
  return b;
}

// recv_row by (token, slot) of a one-rank group's handle: the one-GPU group indexes it by token
// already; the reference group by (source rank, row in the list of tokens sent), and a token with
// every slot masked is not in that list, so it is translated through token_slot.
std::vector<int32_t> recv_rows_by_token(const Group& g, const Handle& h, int T, int K) {
  const Tensor r = to_host(h.state().recv_row);
  std::vector<int32_t> out(static_cast<size_t>(T) * K, -1);
  if (g.transport() == Transport::kLocal) {
    std::copy(r.ptr<int32_t>(), r.ptr<int32_t>() + out.size(), out.begin());
    return out;
  }
  const Tensor slot = to_host(h.state().token_slot);  // [T, R], R = 1
  for (int t = 0; t < T; ++t) {
    const int32_t sl = slot.ptr<int32_t>()[t];
    if (sl < 0) continue;
    for (int k = 0; k < K; ++k) out[static_cast<size_t>(t) * K + k] = r.ptr<int32_t>()[static_cast<int64_t>(sl) * K + k];
  }
  return out;
}

struct Dispatched {
  std::vector<int32_t> offsets, recv_row;
  Tensor x, scales, w;  // host copies of recv_x, recv_scales (or undefined), recv_weights
};

void expect_same_dispatch(const Dispatched& got, const Dispatched& want, const std::string& what,
                          bool check_recv_row = true) {
  SCOPED_TRACE(what);
  ASSERT_EQ(got.offsets, want.offsets) << "expert offsets";
  if (check_recv_row) {
    EXPECT_EQ(got.recv_row, want.recv_row) << "recv_row (the destination row of every (token, slot))";
  }
  const int64_t used = want.offsets.back();
  EXPECT_TRUE(bit_equal(got.x.ref().slice_rows(0, used), want.x.ref().slice_rows(0, used))) << "recv_x";
  if (want.scales.defined()) {
    EXPECT_TRUE(bit_equal(got.scales.ref().slice_rows(0, used), want.scales.ref().slice_rows(0, used)))
        << "recv_scales";
  }
  EXPECT_TRUE(bit_equal(got.w.ref().slice_rows(0, used), want.w.ref().slice_rows(0, used))) << "recv_weights";
}

// The host reference group's plain or quantized (fp8 + scales) dispatch.
Dispatched reference_dispatch(const Case& c, const Inputs& in, const Tensor& x, const Tensor& x_scales) {
  auto host = Group::create_simulated(1, config_of(c));
  Group& g = host[0];
  const int64_t cap = g.recv_capacity_rows();
  Dispatched d;
  d.x = Tensor::full({cap, c.H}, x.dtype(), 0.0);
  d.w = Tensor::full({cap}, DType::kF32, -1.0);
  if (x_scales.defined()) d.scales = Tensor::zeros({cap, x_scales.size(1)}, x_scales.dtype());
  Handle h = prepare(g, in.idx, in.w);
  dispatch_forward(g, h, x, x_scales, in.w, d.x, d.scales, d.w, {});
  g.check();
  d.offsets = h.expert_offsets_host();
  d.recv_row = recv_rows_by_token(g, h, c.T, c.K);
  return d;
}

struct KernelRun {
  cuda::PermuteKernel kernel;
  int max_ctas;
  int x_offset, recv_offset, scale_offset;  // bytes
};

std::string describe(const KernelRun& k) {
  return detail::concat("kernel=", cuda::permute_kernel_name(k.kernel), " max_ctas=", k.max_ctas, " x+", k.x_offset,
                        " recv_x+", k.recv_offset, " scales+", k.scale_offset);
}

Dispatched launcher_dispatch(Group& g, const Case& c, const Inputs& in, const Tensor& x_host, const Tensor& s_host,
                             const KernelRun& k, int poison) {
  const int64_t cap = g.recv_capacity_rows();
  OffsetBuffer x = offset_copy(x_host, k.x_offset);
  OffsetBuffer xs = s_host.defined() ? offset_copy(s_host, k.x_offset ? 4 : 0) : OffsetBuffer{};
  OffsetBuffer rx = offset_buffer({cap, c.H}, x_host.dtype(), k.recv_offset, poison);
  OffsetBuffer rs = s_host.defined() ? offset_buffer({cap, s_host.size(1)}, s_host.dtype(), k.scale_offset, poison)
                                     : OffsetBuffer{};
  Tensor rw = Tensor::empty({cap}, DType::kF32, Device::cuda(0));
  detail::memset_bytes(rw.data(), rw.device(), poison, rw.nbytes());
  Tensor w = to_gpu(in.w);
  Handle h = prepare(g, to_gpu(in.idx), w);
  cuda::PermuteTuning tuning;
  tuning.kernel = k.kernel;
  tuning.max_ctas = k.max_ctas;
  cuda::permute_forward(h.state(), x.view, xs.view, w, rx.view, rs.view, rw, cap, c.align, Stream{}, tuning);
  g.check();
  Dispatched d;
  d.offsets = h.expert_offsets_host();
  d.recv_row = recv_rows_by_token(g, h, c.T, c.K);
  d.x = to_host(rx.view);
  if (s_host.defined()) d.scales = to_host(rs.view);
  d.w = to_host(rw);
  return d;
}

std::vector<KernelRun> kernel_runs() {
  using cuda::PermuteKernel;
  return {{PermuteKernel::kWarp, 0, 0, 0, 0},  {PermuteKernel::kBulk, 0, 0, 0, 0},
          {PermuteKernel::kWarp, 2, 0, 0, 0},  {PermuteKernel::kBulk, 2, 0, 0, 0},
          {PermuteKernel::kBulk, 1, 0, 0, 0},  {PermuteKernel::kBulk, 3, 4, 0, 0},   // x misaligned: warp fallback
          {PermuteKernel::kBulk, 3, 0, 8, 4},  {PermuteKernel::kWarp, 3, 0, 8, 1}};
}

TEST(EpLocalGpu, DispatchKernelsMatchReference) {
  EPX_REQUIRE_GPU();
  for (int align : {1, 128})
    for (DType p : {DType::kBF16, DType::kF32, DType::kF16}) {
      Case c;
      c.T = c.max_tokens = 300;
      c.E = 32;
      c.K = 8;
      c.H = 136;  // 272-byte bf16 rows: 16-byte multiple, not a power of two
      c.align = align;
      c.payload = p;
      c.zipf = 2;
      SCOPED_TRACE(describe(c));
      Group g = Group::create_local(config_of(c), 0);
      const Inputs in = make_inputs(c, 0);
      const Dispatched want = reference_dispatch(c, in, in.x, Tensor());
      int poison = 0x11;
      for (const KernelRun& k : kernel_runs()) {
        if (k.recv_offset % static_cast<int>(dtype_size(p)) != 0) continue;  // rows stay element-aligned
        expect_same_dispatch(launcher_dispatch(g, c, in, in.x, Tensor(), k, poison += 0x22), want, describe(k));
      }
    }
}

TEST(EpLocalGpu, QuantizedDispatchKernelsMatchReference) {
  EPX_REQUIRE_GPU();
  // fp8 rows with their scale rows: 1x128 fp32 scales of 16 bytes (bulk) and 12 bytes (lanes), MX
  // e8m0 scales of 16 bytes (bulk) and 12 bytes (lanes).
  for (QuantRecipe r : {QuantRecipe::kFp8Block1x128, QuantRecipe::kMxfp8Rowwise})
    for (int H : {512, 384})
      for (int align : {1, 32}) {
        Case c;
        c.T = c.max_tokens = 200;
        c.E = 16;
        c.K = 6;
        c.H = H;
        c.align = align;
        c.payload = DType::kBF16;
        SCOPED_TRACE(detail::concat(describe(c), " ", quant_recipe_name(r)));
        Group g = Group::create_local(config_of(c), 0);
        const Inputs in = make_inputs(c, 0);
        Tensor q = Tensor::empty({c.T, H}, DType::kF8E4M3), sc = Tensor::empty(quant_scale_shape(r, c.T, H), quant_scale_dtype(r));
        quantize(r, in.x, q, sc);
        const Dispatched want = reference_dispatch(c, in, q, sc);
        int poison = 0x13;
        for (const KernelRun& k : kernel_runs()) {
          if (r == QuantRecipe::kFp8Block1x128 && k.scale_offset % 4 != 0) continue;  // fp32 scales stay aligned
          expect_same_dispatch(launcher_dispatch(g, c, in, q, sc, k, poison += 0x22), want, describe(k));
        }
      }
}

// ---- quantize on the way ------------------------------------------------------------------

struct QuantVariant {
  QuantRecipe recipe;
  E8M0Rounding rounding;
};
constexpr QuantVariant kQuantVariants[] = {{QuantRecipe::kFp8Block1x128, E8M0Rounding::kFloor},
                                           {QuantRecipe::kMxfp8Rowwise, E8M0Rounding::kFloor},
                                           {QuantRecipe::kMxfp8Rowwise, E8M0Rounding::kCeil}};

std::string describe(const QuantVariant& v) {
  return detail::concat(quant_recipe_name(v.recipe),
                        v.recipe == QuantRecipe::kMxfp8Rowwise
                            ? (v.rounding == E8M0Rounding::kCeil ? "/ceil" : "/floor")
                            : "");
}

void store_bits(Tensor& x, int64_t i, uint32_t bits) {
  const size_t es = dtype_size(x.dtype());
  if (es == 4) std::memcpy(static_cast<char*>(x.data()) + 4 * i, &bits, 4);
  else {
    const uint16_t b = static_cast<uint16_t>(bits);
    std::memcpy(static_cast<char*>(x.data()) + 2 * i, &b, 2);
  }
}

// Token rows for the quantizer: blocks of very different magnitudes (exponents drawn per 32
// columns, exact zeros sprinkled in). With `special`, row t % 8 picks a pattern: 0 random, 1 all
// zeros (the 1e-4 floor / E8M0 bits 0), 2 the dtype's largest finite values and their negatives,
// 3 NaNs of both signs with payloads among finite values, 4 +-inf among finite values, 5
// subnormals of the dtype only, 6 one block entirely NaN and one entirely inf, 7 a single nonzero
// element per block.
Tensor quant_input(int T, int H, DType dt, uint32_t seed, bool special) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int lo = dt == DType::kF16 ? -14 : -60, hi = dt == DType::kF16 ? 14 : 60;
  std::uniform_int_distribution<int> expo(lo, hi);
  Tensor x = Tensor::empty({T, H}, dt);
  const bool f32 = dt == DType::kF32, f16 = dt == DType::kF16;
  const uint32_t max_bits = f32 ? 0x7f7fffffu : f16 ? 0x7bffu : 0x7f7fu;
  const uint32_t inf_bits = f32 ? 0x7f800000u : f16 ? 0x7c00u : 0x7f80u;
  const uint32_t nan_bits = f32 ? 0x7fc00001u : f16 ? 0x7e01u : 0x7fc1u;
  const uint32_t sign = f32 ? 0x80000000u : 0x8000u;
  const uint32_t subnormal_top = f32 ? 0x007fffffu : f16 ? 0x03ffu : 0x007fu;
  for (int t = 0; t < T; ++t) {
    std::vector<int> block_exp(H / 32 + 1);
    for (int& e : block_exp) e = expo(rng);
    for (int j = 0; j < H; ++j) {
      const int64_t i = static_cast<int64_t>(t) * H + j;
      const double v = (rng() % 13 == 0) ? 0.0 : std::ldexp(normal(rng), block_exp[j / 32]);
      store_from_double(x.data(), dt, i, v);
      if (!special) continue;
      const uint32_t r = rng();
      switch (t % 8) {
        case 1: store_from_double(x.data(), dt, i, (r & 1) ? 0.0 : -0.0); break;
        case 2: store_bits(x, i, max_bits | ((r & 1) ? sign : 0u)); break;
        case 3: if (r % 5 == 0) store_bits(x, i, nan_bits + (r >> 28) + ((r & 2) ? sign : 0u)); break;
        case 4: if (r % 7 == 0) store_bits(x, i, inf_bits | ((r & 2) ? sign : 0u)); break;
        case 5: store_bits(x, i, ((r >> 8) % subnormal_top + 1) | ((r & 1) ? sign : 0u)); break;
        case 6:
          if (j / 128 == 0) store_bits(x, i, nan_bits | ((r & 1) ? sign : 0u));
          else if (j / 128 == 1) store_bits(x, i, inf_bits | ((r & 1) ? sign : 0u));
          break;
        case 7: if (j % 32 != 5) store_from_double(x.data(), dt, i, 0.0); break;
        default: break;
      }
    }
  }
  return x;
}

enum class QPath { kPublic, kComposed, kLauncher };

constexpr cuda::QuantizeSchedule kQuantizeSchedules[] = {
    cuda::QuantizeSchedule::kBatched, cuda::QuantizeSchedule::kPipelined, cuda::QuantizeSchedule::kPipelinedOneStage};

// Quantize-on-the-way dispatch of x on `g` through one of three paths: the public entry point (the
// fused kernel on the one-GPU group, the composition on the host group), quantize then the
// quantized dispatch, or the fused launcher with explicit tuning and buffer offsets.
Dispatched quant_dispatch(Group& g, const Case& c, const QuantVariant& v, const Inputs& in, const Tensor& x_host,
                          QPath path, int poison, const KernelRun& k = {},
                          cuda::QuantizeSchedule schedule = cuda::QuantizeSchedule::kAuto) {
  const bool on_gpu = g.device().is_cuda();
  const Device dev = g.device();
  const int64_t cap = g.recv_capacity_rows();
  const Shape ss = quant_scale_shape(v.recipe, cap, c.H);
  const DType sdt = quant_scale_dtype(v.recipe);
  auto put = [&](const Tensor& t) { return on_gpu ? to_gpu(t) : t.clone(); };
  auto poisoned = [&](Shape s, DType dt) {
    Tensor t = Tensor::empty(s, dt, dev);
    detail::memset_bytes(t.data(), dev, poison, t.nbytes());
    return t;
  };
  QuantOptions opt;
  opt.mx_rounding = v.rounding;
  Tensor idx = put(in.idx), w = put(in.w);
  Tensor rw = poisoned({cap}, DType::kF32);
  Handle h = prepare(g, idx, w);
  Dispatched d;
  if (path == QPath::kLauncher) {
    OffsetBuffer x = offset_copy(x_host, k.x_offset);
    OffsetBuffer rx = offset_buffer({cap, c.H}, DType::kF8E4M3, k.recv_offset, poison);
    OffsetBuffer rs = offset_buffer(ss, sdt, k.scale_offset, poison);
    cuda::PermuteTuning tuning;
    tuning.kernel = k.kernel;
    tuning.max_ctas = k.max_ctas;
    tuning.quantize_schedule = schedule;
    cuda::permute_quantize_forward(h.state(), v.recipe, v.rounding, x.view, w, rx.view, rs.view, rw, cap, c.align,
                                   Stream{}, tuning);
    g.check();
    d.x = to_host(rx.view);
    d.scales = to_host(rs.view);
  } else {
    Tensor x = put(x_host);
    Tensor rx = poisoned({cap, c.H}, DType::kF8E4M3), rs = poisoned(ss, sdt);
    if (path == QPath::kPublic) {
      dispatch_forward(g, h, x, {}, w, rx, rs, rw, {}, opt);
    } else {
      Tensor q = Tensor::empty({c.T, c.H}, DType::kF8E4M3, dev);
      Tensor s = Tensor::empty(quant_scale_shape(v.recipe, c.T, c.H), sdt, dev);
      quantize(v.recipe, x, q, s, opt);
      dispatch_forward(g, h, q, s, w, rx, rs, rw);
    }
    g.check();
    d.x = to_host(rx);
    d.scales = to_host(rs);
  }
  d.offsets = h.expert_offsets_host();
  d.recv_row = recv_rows_by_token(g, h, c.T, c.K);
  d.w = to_host(rw);
  return d;
}

// Fused (public entry point on the one-GPU group) vs quantize-then-dispatch on the GPU vs the CPU
// reference group, for every recipe and rounding.
void compare_quant(const Case& c, bool special) {
  auto host = Group::create_simulated(1, config_of(c));
  Group gpu = Group::create_local(config_of(c), 0);
  const Inputs in = make_inputs(c, 0);
  const Tensor x = quant_input(c.T, c.H, c.payload, c.seed, special);
  for (const QuantVariant& v : kQuantVariants) {
    SCOPED_TRACE(detail::concat(describe(c), " ", describe(v), special ? " special values" : ""));
    const Dispatched want = quant_dispatch(host[0], c, v, in, x, QPath::kPublic, 0xAB);
    const Dispatched fused = quant_dispatch(gpu, c, v, in, x, QPath::kPublic, 0x5C);
    const Dispatched composed = quant_dispatch(gpu, c, v, in, x, QPath::kComposed, 0x33);
    expect_same_dispatch(fused, composed, "fused vs quantize then dispatch (GPU)");
    expect_same_dispatch(fused, want, "fused vs CPU reference");
    expect_same_dispatch(composed, want, "quantize then dispatch (GPU) vs CPU reference");
  }
}

TEST(EpLocalGpuQuantize, FusedMatchesComposedAndReference) {
  EPX_REQUIRE_GPU();
  // H = 512: scale rows of 16 bytes (bulk stores); H = 384: 12 bytes (lane stores).
  for (DType p : {DType::kBF16, DType::kF16, DType::kF32})
    for (int align : {1, 32, 128})
      for (int H : {512, 384}) {
        Case c;
        c.payload = p;
        c.align = align;
        c.H = H;
        c.seed = 100 + align + H;
        compare_quant(c, false);
      }
}

TEST(EpLocalGpuQuantize, ZerosExtremesInfinitiesAndNaNs) {
  EPX_REQUIRE_GPU();
  for (DType p : {DType::kBF16, DType::kF16, DType::kF32}) {
    Case c;
    c.payload = p;
    c.H = 512;
    c.align = 32;
    compare_quant(c, true);
  }
}

TEST(EpLocalGpuQuantize, AdversarialRouting) {
  EPX_REQUIRE_GPU();
  for (int align : {1, 128}) {
    Case hot;  // every token to expert 5 only
    hot.hot = 5;
    hot.mask_p = 1.0;
    Case skew;  // most pairs on the first experts, many experts empty
    skew.zipf = 4;
    Case masked;
    masked.mask_p = 0.7;
    Case all_masked;
    all_masked.mask_p = 1.0;
    Case empty;
    empty.T = 0;
    for (Case c : {hot, skew, masked, all_masked, empty}) {
      c.H = 256;
      c.align = align;
      compare_quant(c, true);
    }
  }
}

TEST(EpLocalGpuQuantize, FullBatchAndModelHidden) {
  EPX_REQUIRE_GPU();
  Case full;  // T = max, many experts: several layout blocks, every warp walks several tokens
  full.T = full.max_tokens = 3000;
  full.E = 256;
  full.K = 8;
  full.H = 512;
  full.align = 128;
  compare_quant(full, true);
  Case model;  // DeepSeek-V3's hidden size: 7168-byte fp8 rows, 224-byte scale rows
  model.T = model.max_tokens = 96;
  model.E = 32;
  model.K = 8;
  model.H = 7168;
  model.align = 32;
  compare_quant(model, false);
  Case k1;
  k1.K = 1;
  k1.H = 128;
  compare_quant(k1, true);
}

// The fused launcher with every schedule and each of `runs` (kernel, CTA cap, buffer offsets) against
// the CPU reference, for every recipe and rounding; runs whose offsets the payload or the scales cannot
// take are left out (x stays element-aligned, fp32 scales 4-byte aligned).
void compare_launcher_runs(const Case& c, uint32_t x_seed, const std::vector<KernelRun>& runs, int first_poison) {
  Group gpu = Group::create_local(config_of(c), 0);
  auto host = Group::create_simulated(1, config_of(c));
  const Inputs in = make_inputs(c, 0);
  const Tensor x = quant_input(c.T, c.H, c.payload, x_seed, true);
  for (const QuantVariant& v : kQuantVariants) {
    const Dispatched want = quant_dispatch(host[0], c, v, in, x, QPath::kPublic, 0xEE);
    int poison = first_poison;
    for (cuda::QuantizeSchedule schedule : kQuantizeSchedules)
      for (const KernelRun& k : runs) {
        if (k.x_offset % static_cast<int>(dtype_size(c.payload)) != 0) continue;
        if (v.recipe == QuantRecipe::kFp8Block1x128 && k.scale_offset % 4 != 0) continue;
        SCOPED_TRACE(detail::concat(describe(c), " ", describe(v), " ", describe(k), " schedule=",
                                    cuda::quantize_schedule_name(schedule)));
        expect_same_dispatch(quant_dispatch(gpu, c, v, in, x, QPath::kLauncher, poison += 0x26, k, schedule), want,
                             "fused launcher vs CPU reference");
      }
  }
}

// Every schedule (batched or pipelined x loads, one or two staged rows a warp): rows shorter than one
// batch (H = 512), model-sized rows whose last batch is partial (H = 7168: 3.5 batches for bf16), few
// CTAs so each warp walks many tokens and the pipelined loads cross tokens, x 16-byte aligned and
// only element-aligned (x + 4 bytes).
TEST(EpLocalGpuQuantize, SchedulesMatchReference) {
  EPX_REQUIRE_GPU();
  Case many;
  many.T = many.max_tokens = 700;
  many.E = 64;
  many.K = 8;
  many.H = 512;
  many.align = 128;
  many.zipf = 1.2;
  Case model;
  model.T = model.max_tokens = 64;
  model.E = 32;
  model.K = 8;
  model.H = 7168;
  model.align = 32;
  const std::vector<KernelRun> runs = {{cuda::PermuteKernel::kBulk, 0, 0, 0, 0},
                                       {cuda::PermuteKernel::kBulk, 3, 0, 0, 0},
                                       {cuda::PermuteKernel::kWarp, 5, 4, 0, 0}};
  for (DType p : {DType::kBF16, DType::kF32})
    for (Case c : {many, model}) {
      c.payload = p;
      compare_launcher_runs(c, 11, runs, 0x17);
    }
}

TEST(EpLocalGpuQuantize, KernelVariantsAndMisalignedBuffers) {
  EPX_REQUIRE_GPU();
  using cuda::PermuteKernel;
  // bulk / lane stores, the grid-stride loops (1-3 CTAs), x element-aligned but not 16-byte
  // aligned (element-wise loads), recv_x / recv_scales off their 16-byte alignment (lane stores).
  const std::vector<KernelRun> runs = {
      {PermuteKernel::kBulk, 0, 0, 0, 0}, {PermuteKernel::kWarp, 0, 0, 0, 0}, {PermuteKernel::kBulk, 1, 0, 0, 0},
      {PermuteKernel::kBulk, 3, 0, 0, 0}, {PermuteKernel::kWarp, 2, 0, 0, 0}, {PermuteKernel::kBulk, 3, 4, 0, 0},
      {PermuteKernel::kBulk, 2, 0, 8, 4}, {PermuteKernel::kBulk, 2, 0, 0, 4}, {PermuteKernel::kWarp, 3, 4, 1, 1},
      {PermuteKernel::kBulk, 0, 0, 4, 8}};
  for (DType p : {DType::kBF16, DType::kF32})
    for (int align : {1, 32}) {
      Case c;
      c.T = c.max_tokens = 150;
      c.E = 16;
      c.K = 8;
      c.H = 512;
      c.payload = p;
      c.align = align;
      c.zipf = 1.5;
      compare_launcher_runs(c, 7, runs, 0x21);
    }
}

// The composed path of a backend without the fused kernel, on the GPU: a one-rank NCCL group (the
// staged transport: a one-rank communicator has no symmetric-memory peers) quantizes into a
// stream-ordered temporary and sends that.
TEST(EpLocalGpuQuantize, ComposedOnOneRankNcclGroupMatchesReference) {
  EPX_REQUIRE_GPU();
  Case c;
  c.H = 512;
  c.align = 32;
  c.zipf = 2;
  std::vector<Group> nccl = Group::create_all_local(config_of(c), {0});
  ASSERT_EQ(nccl[0].transport(), Transport::kStaged);
  ASSERT_FALSE(nccl[0].state().fuses_quantize_dispatch());
  auto host = Group::create_simulated(1, config_of(c));
  const Inputs in = make_inputs(c, 0);
  const Tensor x = quant_input(c.T, c.H, c.payload, 5, true);
  for (const QuantVariant& v : kQuantVariants) {
    SCOPED_TRACE(describe(v));
    const Dispatched want = quant_dispatch(host[0], c, v, in, x, QPath::kPublic, 0xAB);
    expect_same_dispatch(quant_dispatch(nccl[0], c, v, in, x, QPath::kPublic, 0x66), want,
                         "composed on the NCCL group vs CPU reference", /*check_recv_row=*/false);
  }
}

TEST(EpLocalGpuQuantize, RecvOverflowWritesNothing) {
  EPX_REQUIRE_GPU();
  Case c;
  c.hot = 3;
  c.mask_p = 1.0;
  c.H = 128;
  GroupConfig cfg = config_of(c);
  cfg.recv_capacity_rows = 10;  // 64 rows would be needed
  Group g = Group::create_local(cfg, 0);
  Inputs in = make_inputs(c, 0);
  Tensor rx = to_gpu(Tensor::full({10, c.H}, DType::kF8E4M3, 3.0));
  Tensor rs = to_gpu(Tensor::full({10, 1}, DType::kF32, 7.0));
  Handle h = prepare(g, to_gpu(in.idx), {});
  dispatch_forward(g, h, to_gpu(in.x), {}, {}, rx, rs, {});
  EXPECT_THROW(g.check(), Error);
  Tensor back = to_host(rx), back_s = to_host(rs);
  for (int64_t i = 0; i < back.numel(); ++i) ASSERT_EQ(back.item(i), 3.0) << "overflowing dispatch wrote code " << i;
  for (int64_t i = 0; i < back_s.numel(); ++i) ASSERT_EQ(back_s.item(i), 7.0) << "overflowing dispatch wrote scale " << i;
}

TEST(EpLocalGpuQuantize, GraphReplayIsBitIdenticalToEager) {
  EPX_REQUIRE_GPU();
  Case c;
  c.T = c.max_tokens = 256;
  c.E = 32;
  c.K = 8;
  c.H = 512;
  c.align = 32;
  Group g = Group::create_local(config_of(c), 0);
  const Inputs in = make_inputs(c, 0);
  const int64_t cap = g.recv_capacity_rows();
  Tensor idx = to_gpu(in.idx), w = to_gpu(in.w), x = to_gpu(quant_input(c.T, c.H, c.payload, 3, true));
  Tensor rx = to_gpu(Tensor::zeros({cap, c.H}, DType::kF8E4M3)), rs = to_gpu(Tensor::zeros({cap, c.H / 32}, DType::kE8M0));
  QuantOptions opt;
  opt.mx_rounding = E8M0Rounding::kCeil;
  auto step = [&](Stream s) {
    Handle h = prepare(g, idx, w, {}, s);
    dispatch_forward(g, h, x, {}, w, rx, rs, {}, s, opt);
  };
  step({});
  g.check();
  const Tensor want_x = to_host(rx), want_s = to_host(rs);
  const int64_t used = [&] {
    Handle h = prepare(g, idx, w);
    return static_cast<int64_t>(h.expert_offsets_host().back());
  }();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  step(Stream{stream});
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 5; ++i) {
    ASSERT_EQ(cudaMemsetAsync(rx.data(), 0x5A, rx.nbytes(), stream), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(rs.data(), 0x5A, rs.nbytes(), stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const Tensor got_x = to_host(rx), got_s = to_host(rs);
    ASSERT_TRUE(bit_equal(got_x.ref().slice_rows(0, used), want_x.ref().slice_rows(0, used))) << "replay " << i;
    ASSERT_TRUE(bit_equal(got_s.ref().slice_rows(0, used), want_s.ref().slice_rows(0, used))) << "replay " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(EpLocalGpuQuantize, BadArgumentsNameTheArgument) {
  EPX_REQUIRE_GPU();
  Case c;
  c.H = 256;
  Group g = Group::create_local(config_of(c), 0);
  const Inputs in = make_inputs(c, 0);
  const int64_t cap = g.recv_capacity_rows();
  Tensor x = to_gpu(in.x), idx = to_gpu(in.idx);
  Tensor rx = Tensor::empty({cap, c.H}, DType::kF8E4M3, Device::cuda(0));
  auto error_of = [&](const TensorRef& recv_x, const TensorRef& recv_s) {
    Handle h = prepare(g, idx, {});
    try {
      dispatch_forward(g, h, x, {}, {}, recv_x, recv_s, {});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  Tensor s3 = Tensor::empty({cap, 3}, DType::kF32, Device::cuda(0));
  std::string e = error_of(rx, s3);
  EXPECT_NE(e.find("recv_scales has shape [" + std::to_string(cap) + ", 3], expected [>= " + std::to_string(cap) +
                   ", 2]"),
            std::string::npos)
      << e;
  Tensor sbf = Tensor::empty({cap, 2}, DType::kBF16, Device::cuda(0));
  e = error_of(rx, sbf);
  EXPECT_NE(e.find("recv_scales has dtype bf16, expected fp32 or e8m0"), std::string::npos) << e;
  Tensor rbf = Tensor::empty({cap, c.H}, DType::kBF16, Device::cuda(0));
  Tensor s2 = Tensor::empty({cap, 2}, DType::kF32, Device::cuda(0));
  e = error_of(rbf, s2);
  EXPECT_NE(e.find("recv_x has dtype bf16, expected fp8_e4m3"), std::string::npos) << e;
  g.check();
}

}  // namespace
}  // namespace epx
