// Multi-rank test procedures shared by the one-process (tests/gpu, create_all_local) and the
// one-process-per-GPU (tests/multigpu, create_from_env) GPU suites, and run on the host backend by
// tests/cpu/test_ep_procedures.cpp (so the procedures themselves are exercised where no GPU is):
// every rank of the group runs the same procedure on its own view, in the same order of
// collective calls. The CUDA graph procedure exists only in builds with the CUDA backend.
//
// `sync` is a host barrier between the ranks of one process (a no-op with one rank per process): no
// rank allocates or frees device memory, or instantiates a graph, while a peer's collective may
// still be in flight (see Group::create_all_local). A failed comparison never skips a collective
// call, so a mismatch on one rank cannot leave the others waiting.
#pragma once

#include <gtest/gtest.h>
#if defined(EPX_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <chrono>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/ep_scenario.h"
#include "gpu/ep_compare.h"

namespace epx::testing {

#if defined(EPX_HAVE_CUDA)
inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(Status::kCudaError, detail::concat(what, ": ", cudaGetErrorString(e)));
}

/// Fills every output of a run with 0xff bytes (NaN for floats), stream-ordered.
inline void poison_outputs(EpRun& r, cudaStream_t s) {
  for (Tensor* t : {&r.recv_x, &r.recv_w, &r.out, &r.d_y, &r.d_row_w, &r.d_x, &r.d_topk_w})
    if (t->nbytes() > 0) cuda_ok(cudaMemsetAsync(t->data(), 0xff, t->nbytes(), s), "cudaMemsetAsync (poison)");
}

/// The four ops (prepare included) run eagerly on a stream of this rank's, then the same four on
/// a second set of buffers captured into a CUDA graph and replayed `replays` times with the outputs
/// poisoned before each replay. Expected: the eager run equals the reference `want` (the CPU
/// oracle of this rank), and every replay equals the eager run bit for bit.
inline void check_graph_replay(Group& g, const EpCase& c, const EpOutputs& want, int replays,
                               const std::function<void()>& sync) {
  cuda_ok(cudaSetDevice(g.device().index), "cudaSetDevice");
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  EpRun eager(g, c), graphed(g, c);
  sync();
  eager.all_four(g, Stream{s});
  cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize (eager run)");
  g.check();
  const EpOutputs eager_out = eager.outputs();
  expect_same_ep_outputs(eager_out, want, g.rank());
  sync();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  // Thread-local capture: the other ranks of this process capture at the same time on their threads.
  cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  graphed.all_four(g, Stream{s});
  cuda_ok(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  sync();
  for (int i = 0; i < replays; ++i) {
    poison_outputs(graphed, s);
    cuda_ok(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
    cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize (replay)");
    expect_identical_ep_outputs(graphed.outputs(), eager_out,
                                detail::concat("rank ", g.rank(), ", graph replay ", i, " vs the eager run"));
  }
  g.check();
  sync();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  sync();
}
#endif  // EPX_HAVE_CUDA

/// Three microbatches of different routings in flight on one group, like a pipeline schedule:
/// forwards interleaved (prepare 0, prepare 1, dispatch 1, dispatch 0, prepare 2, combine 0,
/// dispatch 2, combine 2, combine 1), then the backwards in yet another order (combine_bwd 2,
/// combine_bwd 0, dispatch_bwd 2, combine_bwd 1, dispatch_bwd 0, dispatch_bwd 1). Each microbatch
/// must equal the reference of that microbatch run alone: want[mb][rank].
inline void check_interleaved_microbatches(Group& g, const std::vector<EpCase>& mbs,
                                           const std::vector<std::vector<EpOutputs>>& want,
                                           const std::function<void()>& sync) {
  std::vector<EpRun> runs;
  runs.reserve(mbs.size());
  for (const EpCase& c : mbs) runs.emplace_back(g, c);
  sync();
  runs[0].prepare(g);
  runs[1].prepare(g);
  runs[1].dispatch(g);
  runs[0].dispatch(g);
  runs[2].prepare(g);
  runs[0].combine(g);
  runs[2].dispatch(g);
  runs[2].combine(g);
  runs[1].combine(g);
  runs[2].combine_bwd(g);
  runs[0].combine_bwd(g);
  runs[2].dispatch_bwd(g);
  runs[1].combine_bwd(g);
  runs[0].dispatch_bwd(g);
  runs[1].dispatch_bwd(g);
  g.check();
  sync();
  for (size_t i = 0; i < runs.size(); ++i) {
    SCOPED_TRACE(detail::concat("microbatch ", i, ": ", mbs[i].str()));
    expect_same_ep_outputs(runs[i].outputs(), want[i][g.rank()], g.rank());
  }
  sync();
}

/// The graph-replay procedure's case: skewed routing over short rows, top-8.
inline EpCase graph_replay_case(int ranks) {
  EpCase c;
  c.ranks = ranks;
  c.E = 8 * ranks;
  c.max_tokens = 256;
  c.K = 8;
  c.H = 128;
  c.align = 16;
  c.zipf = 2;
  return c;
}

/// The drift procedure's case (check_drifting_op_sequences): skewed routing, top-4, small batches.
inline EpCase drift_case(int ranks) {
  EpCase c;
  c.ranks = ranks;
  c.E = 8 * ranks;
  c.max_tokens = 96;
  c.K = 4;
  c.H = 256;
  c.zipf = 2;
  return c;
}

/// Three microbatch cases sharing one group configuration (E, K, H, max_tokens, align) with
/// different routings, token counts and payload dtypes.
inline std::vector<EpCase> microbatch_cases(int ranks) {
  EpCase base;
  base.ranks = ranks;
  base.E = 8 * ranks;
  base.align = 16;
  base.max_tokens = 96;
  std::vector<EpCase> v(3, base);
  v[0].seed = 11;
  v[1].seed = 12;
  v[1].zipf = 3;
  v[1].payload = DType::kF32;
  v[1].tokens.clear();
  for (int r = 0; r < ranks; ++r) v[1].tokens.push_back(r == 0 ? 0 : 96 - 7 * r);
  v[2].seed = 13;
  v[2].only_rank = ranks - 1;
  v[2].mask_p = 0.3;
  v[2].tokens.clear();
  for (int r = 0; r < ranks; ++r) v[2].tokens.push_back(50 + r);
  return v;
}

/// Sum of a float buffer over the group: every rank's result equals the sum in rank order.
inline void check_all_reduce(Group& g, int64_t n, const std::function<void()>& sync) {
  const int R = g.size();
  Tensor h = Tensor::empty({n}, DType::kF32);
  for (int64_t i = 0; i < n; ++i) h.ptr<float>()[i] = static_cast<float>(i % 97) + 0.5f * g.rank() + 1e-3f * (i % 7);
  Tensor d = h.to(g.device());
  sync();
  all_reduce_sum(g, d);
  g.check();
  sync();
  Tensor back = d.to(Device::cpu());
  for (int64_t i = 0; i < n; ++i) {
    float want = 0;
    for (int s = 0; s < R; ++s) want += static_cast<float>(i % 97) + 0.5f * s + 1e-3f * (i % 7);
    ASSERT_EQ(back.ptr<float>()[i], want) << "rank " << g.rank() << " element " << i << " of " << n;
  }
}

/// Ranks that drift apart: `runs` iterations of the ops (prepare, dispatch, combine, an all-reduce,
/// combine_backward, dispatch_backward) queued back to back with no meeting in between, the host
/// pausing for a random 0-300 us (seeded by `seed` and the rank) before each op, so that one rank's
/// launches start while a peer is still in an earlier op or already in a later one (the opening
/// barriers, arrival counters and their resets then meet ranks out of step). Every op kind follows
/// an overlapped launch once per iteration. Each iteration's outputs equal `want`, and each
/// all-reduce its sum.
inline void check_drifting_op_sequences(Group& g, const EpCase& c, const EpOutputs& want, int runs, unsigned seed,
                                        const std::function<void()>& sync) {
  const int R = g.size();
  constexpr int64_t kReduceElems = 1000;
  std::vector<EpRun> eps;
  std::vector<Tensor> sums;
  eps.reserve(runs);
  for (int i = 0; i < runs; ++i) {
    eps.emplace_back(g, c);
    sums.push_back(Tensor::full({kReduceElems}, DType::kF32, (g.rank() + 1.0) * (i + 1)).to(g.device()));
  }
  std::mt19937 rng(seed * 7919u + static_cast<unsigned>(g.rank()));
  auto pause = [&] { std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300)); };
  sync();
  for (int i = 0; i < runs; ++i) {
    pause();
    eps[i].prepare(g);
    pause();
    eps[i].dispatch(g);
    pause();
    eps[i].combine(g);
    pause();
    all_reduce_sum(g, sums[i]);
    pause();
    eps[i].combine_bwd(g);
    pause();
    eps[i].dispatch_bwd(g);
  }
  g.check();
  sync();
  for (int i = 0; i < runs; ++i) {
    SCOPED_TRACE(detail::concat("iteration ", i, " of ", runs, " (seed ", seed, ")"));
    expect_same_ep_outputs(eps[i].outputs(), want, g.rank());
    const Tensor back = sums[i].to(Device::cpu());
    const float expected = static_cast<float>(R * (R + 1) / 2 * (i + 1));
    for (int64_t k = 0; k < kReduceElems; ++k)
      ASSERT_EQ(back.ptr<float>()[k], expected) << "rank " << g.rank() << " all-reduce element " << k;
  }
  sync();
}

}  // namespace epx::testing
