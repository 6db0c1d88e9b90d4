// The one-GPU group (device prepare + permute kernels) against the host reference group of one
// rank, on the same inputs. Bit-exact: the layout, every dispatched byte, combine and
// dispatch_backward (same fp32 fma/add order per element), d_y of combine_backward (one fp32
// multiply, one rounding) and the weight gradients copied back. With a tolerance: d_row_weights
// (a warp reduction instead of the reference's sequential sum).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/ep_state.h"
#include "epx/comm.h"
#include "epx/error.h"
#include "epx/layout.h"
#include "epx/quant.h"
#include "gpu/gpu_test_util.h"

namespace epx {
namespace {

using testing::all_close;
using testing::bit_equal;
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
  for (int t = 0; t < c.T; ++t) {
    std::vector<char> used(c.E, 0);
    for (int k = 0; k < c.K; ++k) {
      int64_t e = -1;
      if (k == 0 && c.hot >= 0) {
        e = c.hot;
      } else if (u(rng) >= c.mask_p) {
        for (int tries = 0; tries < 64 && e < 0; ++tries) {
          int cand = c.zipf > 0 ? static_cast<int>(std::pow(u(rng), c.zipf) * c.E) : static_cast<int>(u(rng) * c.E);
          cand = std::min(cand, c.E - 1);
          if (!used[cand]) e = cand;
        }
      }
      if (e >= 0) used[e] = 1;
      store_from_double(in.idx.data(), c.idx_dtype, t * c.K + k, static_cast<double>(e));
    }
  }
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
  try {
    g.check();
    FAIL() << "check() must report the overflow";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kCapacityExceeded);
    EXPECT_NE(std::string(e.what()).find("would receive 64 expert-major rows, more than the group's recv capacity of 10"),
              std::string::npos)
        << e.what();
  }
  Tensor back = to_host(recv);
  for (int64_t i = 0; i < back.numel(); ++i) ASSERT_EQ(back.item(i), 3.0) << "overflowing dispatch wrote element " << i;
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

}  // namespace
}  // namespace epx
