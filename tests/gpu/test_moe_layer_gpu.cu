// The MoE layer on one GPU as a training loop uses it: a context reused step after step is
// captured in a CUDA graph (forward + backward; also pipelined and overlapped) and replayed
// bit-identically to eager steps, the pipelined layer matches the plain one, and bf16 expert
// weight gradients are exactly the fp32 ones rounded once.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "core/version.h"
#include "epx/comm.h"
#include "epx/moe.h"
#include "epx/presets.h"
#include "gpu/gpu_test_util.h"
#include "moe/elementwise.h"

namespace epx {
namespace {

using testing::bit_equal;
using testing::to_host;

#define EPX_REQUIRE_GPU_LAYER()                                                                   \
  do {                                                                                            \
    EPX_REQUIRE_GPU();                                                                            \
    if (!build_info().gpu_grouped_gemm) GTEST_SKIP() << "built without the CUTLASS grouped GEMMs"; \
  } while (0)

MoEConfig small_layer() {
  MoEConfig c = moe_config(find_preset("small"), DType::kBF16);
  c.hidden = 128;
  c.ffn_hidden = 64;
  c.shared_ffn_hidden = 64;
  c.router.num_experts = 16;
  return c;
}

GroupConfig group_for(const MoEConfig& c, int tokens) {
  GroupConfig gc;
  gc.num_experts = c.router.num_experts;
  gc.hidden = c.hidden;
  gc.max_tokens_per_rank = tokens;
  gc.max_topk = c.router.topk;
  gc.align = 16;
  return gc;
}

struct Outputs {
  Tensor out, d_x, w_in, w_out, gate, losses;
};

Outputs snapshot(const MoELayer& L, const Tensor& out, const Tensor& d_x, const MoEContext& ctx) {
  return {to_host(out), to_host(d_x), to_host(L.grads().w_in), to_host(L.grads().w_out), to_host(L.grads().gate),
          to_host(ctx.losses())};
}

void expect_bit_equal(const Outputs& a, const Outputs& b, const char* what) {
  EXPECT_TRUE(bit_equal(a.out, b.out)) << what << ": out";
  EXPECT_TRUE(bit_equal(a.d_x, b.d_x)) << what << ": d_x";
  EXPECT_TRUE(bit_equal(a.w_in, b.w_in)) << what << ": d_w_in";
  EXPECT_TRUE(bit_equal(a.w_out, b.w_out)) << what << ": d_w_out";
  EXPECT_TRUE(bit_equal(a.gate, b.gate)) << what << ": d_gate";
  EXPECT_TRUE(bit_equal(a.losses, b.losses)) << what << ": losses";
}

// One forward + backward of each layer (all of one config's shape, on device dev) on the same x
// and d_out drawn from `seed`; what each produced, in order.
std::vector<Outputs> forward_backward_each(std::initializer_list<MoELayer*> layers, int T, uint64_t seed, Device dev) {
  const MoEConfig& c = (*layers.begin())->config();
  Tensor x = Tensor::empty({T, c.hidden}, c.dtype, dev), d_out = Tensor::empty({T, c.hidden}, c.dtype, dev);
  detail::fill_normal(x, seed, 1, 1.0);
  detail::fill_normal(d_out, seed, 2, 0.1);
  std::vector<Outputs> got;
  for (MoELayer* L : layers) {
    Tensor out = Tensor::zeros({T, c.hidden}, c.dtype, dev), d_x = Tensor::zeros({T, c.hidden}, c.dtype, dev);
    MoEContext ctx = L->forward(x, out);
    L->backward(ctx, d_out, d_x);
    EXPECT_EQ(ctx.num_chunks(), L->config().pipeline_chunks);
    got.push_back(snapshot(*L, out, d_x, ctx));
  }
  return got;
}

// Captures a warmed-up forward + backward of layer c, replays it 10 times and on new tokens, and
// compares with eager steps bit for bit.
void check_graph_replay(const MoEConfig& c) {
  const int T = 256;
  GroupConfig gc = group_for(c, T);
  if (c.overlap_communication) gc.num_sms = 16;  // the budget an overlapped layer runs with
  Group g = Group::create_local(gc, 0);
  MoELayer L(g, c);
  L.init_params(11, 0.1);
  const Device dev = g.device();
  Tensor x = Tensor::empty({T, c.hidden}, c.dtype, dev), d_out = Tensor::empty({T, c.hidden}, c.dtype, dev);
  detail::fill_normal(x, 11, 1, 1.0);
  detail::fill_normal(d_out, 11, 2, 0.1);
  Tensor out = Tensor::zeros({T, c.hidden}, c.dtype, dev), d_x = Tensor::zeros({T, c.hidden}, c.dtype, dev);
  cudaStream_t cs = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), cudaSuccess);
  const Stream s{cs};
  MoEContext ctx;
  auto step = [&] {
    L.forward(x, out, ctx, s);
    L.backward(ctx, d_out, d_x, 1.0, 1.0, s);
  };
  step();  // warm-up: buffers, routing block, kernel caches
  step();
  ASSERT_EQ(cudaStreamSynchronize(cs), cudaSuccess);
  const Outputs eager = snapshot(L, out, d_x, ctx);

  // Captured on a stream the layer has never seen (as torch.cuda.graph does after a warm-up on
  // another stream), in the strictest capture mode.
  cudaStream_t capture_stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&capture_stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(capture_stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  L.forward(x, out, ctx, Stream{capture_stream});
  L.backward(ctx, d_out, d_x, 1.0, 1.0, Stream{capture_stream});
  ASSERT_EQ(cudaStreamEndCapture(capture_stream, &graph), cudaSuccess) << "the layer step is not capturable";
  cudaStreamDestroy(capture_stream);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 10; ++i) {
    detail::fill_zero(out, s);
    detail::fill_zero(d_x, s);
    ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
  }
  ASSERT_EQ(cudaStreamSynchronize(cs), cudaSuccess);
  g.check();
  expect_bit_equal(snapshot(L, out, d_x, ctx), eager, "after 10 graph replays");

  // The graph reads the inputs where they live: new tokens in x give the eager result for them.
  detail::fill_normal(x, 12, 1, 1.0);
  ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(cs), cudaSuccess);
  const Outputs replayed = snapshot(L, out, d_x, ctx);
  step();
  ASSERT_EQ(cudaStreamSynchronize(cs), cudaSuccess);
  expect_bit_equal(replayed, snapshot(L, out, d_x, ctx), "new tokens, graph vs eager");
  EXPECT_FALSE(bit_equal(replayed.out, eager.out)) << "new tokens must change the output";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(cs);
}

TEST(MoELayerGpu, GraphOfForwardBackwardReplaysBitIdentically) {
  EPX_REQUIRE_GPU_LAYER();
  check_graph_replay(small_layer());
}

// The pipelined layer (chunks on the layer's own communication stream, forked from and joined
// back to the caller's by events) is capturable the same way.
TEST(MoELayerGpu, GraphOfPipelinedOverlappedStepReplaysBitIdentically) {
  EPX_REQUIRE_GPU_LAYER();
  MoEConfig c = small_layer();
  c.pipeline_chunks = 3;
  c.overlap_communication = true;
  check_graph_replay(c);
}

// Chunked and overlapped against one chunk on the caller's stream: outputs, input and gate
// gradients and losses bit for bit (the GEMMs compute every row alone), expert weight gradients
// within the rounding of sums taken in another order (they add the chunks' sums: where the terms
// cancel, an H200 showed differences of 2e-5 of the value, so the bound is 2^-12 of the value plus a
// twentieth of the largest; a lost or doubled chunk moves the sums by whole terms), or for bf16
// gradients within one bf16 rounding per chunk of a partial sum (2^-8 of it; a partial sum can be as
// large as the largest gradient where the final value cancels). T = 250 makes the chunks uneven.
TEST(MoELayerGpu, PipelineChunksMatchOneChunk) {
  EPX_REQUIRE_GPU_LAYER();
  const int T = 250;
  for (auto [chunks, bf16_grads] : {std::pair<int, bool>{2, false}, {3, false}, {4, false}, {3, true}}) {
    SCOPED_TRACE("chunks " + std::to_string(chunks) + (bf16_grads ? ", bf16 expert gradients" : ""));
    MoEConfig one = small_layer();
    one.expert_grads_in_dtype = bf16_grads;
    MoEConfig many = one;
    many.pipeline_chunks = chunks;
    many.overlap_communication = true;
    GroupConfig gc = group_for(one, T);
    gc.num_sms = 16;
    Group g = Group::create_local(gc, 0);
    MoELayer l1(g, one), ln(g, many);
    l1.init_params(3, 0.1);
    ln.init_params(3, 0.1);
    const std::vector<Outputs> got = forward_backward_each({&l1, &ln}, T, 3, g.device());
    g.check();
    EXPECT_TRUE(bit_equal(got[0].out, got[1].out)) << "out";
    EXPECT_TRUE(bit_equal(got[0].d_x, got[1].d_x)) << "d_x";
    EXPECT_TRUE(bit_equal(got[0].gate, got[1].gate)) << "d_gate";
    EXPECT_TRUE(bit_equal(got[0].losses, got[1].losses)) << "losses";
    using Pair = std::tuple<const Tensor*, const Tensor*, const char*>;
    for (auto [a, b, name] :
         {Pair{&got[0].w_in, &got[1].w_in, "d_w_in"}, Pair{&got[0].w_out, &got[1].w_out, "d_w_out"}}) {
      int64_t bad = 0, nonzero = 0;
      double top = 0;
      for (int64_t i = 0; i < a->numel(); ++i) top = std::max(top, std::abs(a->item(i)));
      for (int64_t i = 0; i < a->numel(); ++i) {
        const double want = a->item(i), have = b->item(i);
        const double tol = bf16_grads ? 0x1p-8 * chunks * (std::abs(want) + top)
                                      : 0x1p-12 * (std::abs(want) + 0.05 * top);
        if (std::abs(have - want) > tol && bad++ < 3)
          ADD_FAILURE() << name << "[" << i << "] = " << have << ", one chunk gives " << want;
        nonzero += want != 0;
      }
      EXPECT_EQ(bad, 0) << name;
      EXPECT_GT(nonzero, 0) << name << " must not be all zero";
    }
  }
}

// Gradient accumulation on the GPU: microbatch A's backward, then B's with accumulate_grads, leave
// each expert gradient (routed and shared: the wgrad epilogue adds the old value, beta = 1) exactly
// fl(G_A + G_B), and the gate's (cuBLASLt with beta = 1) within fp32 rounding of it.
TEST(MoELayerGpu, AccumulatedGradientsAreTheSumOfTheMicrobatches) {
  EPX_REQUIRE_GPU_LAYER();
  const MoEConfig c = small_layer();
  const int T = 128;
  Group g = Group::create_local(group_for(c, T), 0);
  MoELayer L(g, c);
  L.init_params(9, 0.1);
  ASSERT_EQ(L.grads().w_in.dtype(), DType::kF32);
  const Device dev = g.device();
  std::vector<Tensor> x, d_out;
  for (uint64_t m = 0; m < 2; ++m) {
    x.push_back(Tensor::empty({T, c.hidden}, c.dtype, dev));
    d_out.push_back(Tensor::empty({T, c.hidden}, c.dtype, dev));
    detail::fill_normal(x[m], 9 + m, 1, 1.0);
    detail::fill_normal(d_out[m], 9 + m, 2, 0.1);
  }
  Tensor out = Tensor::zeros({T, c.hidden}, c.dtype, dev), d_x = Tensor::zeros({T, c.hidden}, c.dtype, dev);
  const auto which = {&MoEParams::w_in, &MoEParams::w_out, &MoEParams::shared_w_in, &MoEParams::shared_w_out,
                      &MoEParams::gate};
  auto grads = [&] {
    std::vector<Tensor> v;
    for (auto w : which) v.push_back(to_host(L.grads().*w));
    return v;
  };
  std::vector<std::vector<Tensor>> single;
  for (int m = 0; m < 2; ++m) {
    MoEContext ctx = L.forward(x[m], out);
    L.backward(ctx, d_out[m], d_x);
    single.push_back(grads());
  }
  for (int m = 0; m < 2; ++m) {
    MoEContext ctx = L.forward(x[m], out);
    L.backward(ctx, d_out[m], d_x, 1.0, 1.0, {}, /*accumulate_grads=*/m == 1);
  }
  g.check();
  const std::vector<Tensor> acc = grads();
  const char* names[] = {"d_w_in", "d_w_out", "d_shared_w_in", "d_shared_w_out", "d_gate"};
  for (size_t i = 0; i < acc.size(); ++i) {
    const float* a = single[0][i].ptr<float>();
    const float* b = single[1][i].ptr<float>();
    const float* got = acc[i].ptr<float>();
    const bool exact = i < 4;
    int64_t bad = 0, differ = 0;
    for (int64_t k = 0; k < acc[i].numel(); ++k) {
      const float want = a[k] + b[k];
      const bool ok = exact ? got[k] == want : std::abs(got[k] - want) <= 1e-5f * (std::abs(a[k]) + std::abs(b[k])) + 1e-30f;
      if (!ok && bad++ < 3) ADD_FAILURE() << names[i] << "[" << k << "] = " << got[k] << ", expected " << want;
      differ += a[k] != b[k];
    }
    EXPECT_EQ(bad, 0) << names[i];
    EXPECT_GT(differ, 0) << names[i] << ": the microbatches must differ for the test to mean anything";
  }
}

TEST(MoELayerGpu, Bf16ExpertGradsAreRoundedFp32Grads) {
  EPX_REQUIRE_GPU_LAYER();
  MoEConfig c = small_layer();
  MoEConfig cb = c;
  cb.expert_grads_in_dtype = true;
  const int T = 128;
  Group g = Group::create_local(group_for(c, T), 0);
  MoELayer l32(g, c), l16(g, cb);
  l32.init_params(5, 0.1);
  l16.init_params(5, 0.1);
  forward_backward_each({&l32, &l16}, T, 5, g.device());
  g.check();
  ASSERT_EQ(l16.grads().w_in.dtype(), DType::kBF16);
  for (auto which : {&MoEParams::w_in, &MoEParams::w_out}) {
    const Tensor a = to_host(l32.grads().*which), b = to_host(l16.grads().*which);
    Tensor rounded = Tensor::empty(a.shape(), DType::kBF16);
    int64_t nonzero = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      store_from_double(rounded.data(), DType::kBF16, i, a.item(i));
      nonzero += a.item(i) != 0;
    }
    EXPECT_TRUE(bit_equal(b, rounded));
    EXPECT_GT(nonzero, 0);
  }
}

}  // namespace
}  // namespace epx
