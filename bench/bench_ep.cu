// EP dispatch / combine across the local GPUs on the NCCL group: one process driving every visible
// GPU (a thread per rank), or, started by a launcher (RANK and WORLD_SIZE set, e.g.
// scripts/run_ranks.sh), one process per GPU bootstrapped from the launcher's variables (rank 0
// prints); for each transport asked for (zero-copy, staged). Per rank and per op: median time,
// remote bytes / time and its fraction of the copy-engine peer bandwidth measured in the same run,
// DeepEP's "NVL GB/s" (all received rows, local included, x H x 2 bytes / time), the SM budget
// (GroupConfig::num_sms: no EP launch has more blocks; 0 = none: a fixed number of blocks drive the
// link -- 64 in the zero-copy dispatch -- and the receive side takes every SM) and the most SMs a
// launch can occupy, bytes registered, and the bytes a dispatch puts on the wire (the staged
// transport sends the fixed worst case: max_tokens_per_rank rows to every peer, see nccl_group.cpp).
//
// dispatch_us / combine_us are eager (host launches included); dispatch_graph_us / combine_graph_us
// the same ops replayed from a CUDA graph. fp8_dispatch_us (and _graph_us): the dispatch of an x
// already in FP8 with 1x128 scales; fp8_quantizing_dispatch_us: the bf16 x quantized on the way.
// combine_backward_us: the combine's backward with row weights and their gradient against y (the layer
// with MoEConfig::weight_grads_in_ffn off or with expert biases); combine_backward_unweighted_us: without
// them (a copy of d_out to the expert rows, the layer's default: their gradient comes through FC2).
// *_host_us: the host's wall time per call of the enqueue alone (no wait), beside the eager times.
// usage: bench_ep [--tokens T] [--hidden H] [--experts E] [--topk K] [--sms N (default 32; 0 = no budget)]
//                 [--transport zerocopy|staged|both]        (default: sweep, both transports)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "comm/ep_timeline.h"
#include "core/device_memory.h"
#include "core/env_choice.h"
#include "core/host_barrier.h"
#include "core/launcher_env.h"
#include "core/ep_state.h"
#include "epx/comm.h"
#include "epx/layout.h"

using namespace epx;
using bench::JsonLine;

namespace {

int sm_count_of(int device) {
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  return n;
}

using detail::HostBarrier;

double peer_copy_gb_per_s() {
  const size_t bytes = size_t(256) << 20;
  void *a = nullptr, *b = nullptr;
  EPX_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceEnablePeerAccess(1, 0);
  cudaGetLastError();
  EPX_CUDA_CHECK(cudaMalloc(&a, bytes));
  EPX_CUDA_CHECK(cudaSetDevice(1));
  EPX_CUDA_CHECK(cudaMalloc(&b, bytes));
  EPX_CUDA_CHECK(cudaSetDevice(0));
  const double us = bench::time_us([&](int) { EPX_CUDA_CHECK(cudaMemcpyPeerAsync(b, 1, a, 0, bytes)); }, 5, 5, 2);
  cudaFree(a);
  EPX_CUDA_CHECK(cudaSetDevice(1));
  cudaFree(b);
  EPX_CUDA_CHECK(cudaSetDevice(0));
  return bytes / (us * 1e-6) * 1e-9;
}

// Microseconds per op of `op` captured kOps times into one CUDA graph (on this rank's thread) and
// replayed; every rank captures and replays together. The meetings (`meet`: every rank of the group
// arrives) keep graph instantiation and teardown (which may allocate) away from a peer's exchange in
// flight.
double graph_us(const std::function<void()>& meet, const std::function<void(cudaStream_t)>& op) {
  constexpr int kOps = 20, kReplays = 10;
  cudaStream_t s = nullptr;
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t start = nullptr, stop = nullptr;
  EPX_CUDA_CHECK(cudaEventCreate(&start));
  EPX_CUDA_CHECK(cudaEventCreate(&stop));
  meet();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPX_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kOps; ++i) op(s);
  EPX_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  EPX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  meet();
  EPX_CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up
  EPX_CUDA_CHECK(cudaStreamSynchronize(s));
  meet();
  EPX_CUDA_CHECK(cudaEventRecord(start, s));
  for (int i = 0; i < kReplays; ++i) EPX_CUDA_CHECK(cudaGraphLaunch(exec, s));
  EPX_CUDA_CHECK(cudaEventRecord(stop, s));
  EPX_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  meet();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(s);
  meet();
  return ms * 1e3 / (kOps * kReplays);
}

// One launch's timeline (-DEPX_EP_TIMELINE=ON) as a JSON line: for the writer blocks (senders /
// partial reducers) and the reader blocks (expanders / sums), each phase's [min, median, max] over
// the blocks where it occurred, in us after the earliest block's entry.
JsonLine timeline_line(const char* op, int rank, int T, int H, const comm::EpTimeline& t) {
  uint64_t t0 = UINT64_MAX;
  for (int b = 0; b < t.blocks; ++b)
    if (const uint64_t e = t.stamps[b * comm::kTlPhases + comm::kTlEntry]) t0 = std::min(t0, e);
  JsonLine j;
  j.add("impl", "epx").add("op", op).add("rank", rank).add("tokens", T).add("hidden", H).add("blocks", t.blocks)
      .add("writer_blocks", t.writer_blocks);
  const char* phase[comm::kTlPhases] = {"entry", "barrier", "first", "role_done", "exit"};
  for (int role = 0; role < 2; ++role) {
    for (int p = 0; p < comm::kTlPhases; ++p) {
      std::vector<double> v;
      for (int b = role ? t.writer_blocks : 0; b < (role ? t.blocks : std::min(t.writer_blocks, t.blocks)); ++b)
        if (const uint64_t s = t.stamps[b * comm::kTlPhases + p]) v.push_back((s - t0) * 1e-3);
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      j.add(std::string(role ? "readers_" : "writers_") + phase[p] + "_us",
            std::vector<double>{v.front(), v[v.size() / 2], v.back()});
    }
  }
  return j;
}

// launched: this process is one rank of a launcher's job (main reads the launcher's variables once).
void run(int T, int H, int E, int K, int sms, double link, Transport transport, bool launched) {
  GroupConfig cfg;
  cfg.transport = transport;
  cfg.num_experts = E;
  cfg.hidden = H;
  cfg.max_tokens_per_rank = T;
  cfg.max_topk = K;
  cfg.num_sms = sms;
  cfg.align = 1;
  std::vector<Group> groups;
  if (launched) groups.push_back(Group::create_from_env(cfg));
  else groups = Group::create_all_local(cfg);
  const int R = groups.front().size();
  HostBarrier bar(static_cast<int>(groups.size()));
  std::vector<JsonLine> lines(R);
  std::vector<std::vector<JsonLine>> timelines(R);
  run_ranks(groups, [&](Group& g) {
    const Device dev = g.device();
    EPX_CUDA_CHECK(cudaSetDevice(dev.index));
    // Every rank arrives: the threads of this process, or, one process per GPU, the group's ranks
    // through a one-element all-reduce that this rank has waited for.
    Tensor meeting = launched ? Tensor::zeros({1}, DType::kF32, dev) : Tensor();
    auto meet = [&] {
      if (!launched) return bar.wait();
      all_reduce_sum(g, meeting);
      EPX_CUDA_CHECK(cudaDeviceSynchronize());
    };
    const int64_t cap = g.recv_capacity_rows();
    Tensor idx = bench::random_expert_ids(T, E, K, 11 + g.rank(), dev);
    Tensor w = Tensor::full({T, K}, DType::kF32, 0.125).to(dev);
    Tensor x = Tensor::full({T, H}, DType::kBF16, 1.0).to(dev);
    Tensor recv = Tensor::empty({cap, H}, DType::kBF16, dev), rw = Tensor::empty({cap}, DType::kF32, dev);
    Tensor out = Tensor::empty({T, H}, DType::kBF16, dev);
    auto timed = [&](const std::function<void(int)>& fn) {
      meet();
      const double us = bench::time_us(fn, 10, 5, 2);
      meet();
      return us;
    };
    // The host's own cost per call: the enqueue loop's wall time with no wait in it. Where it is
    // close to the eager time, the eager figure is the host's, not the GPU's.
    auto host_enqueue = [&](const std::function<void(int)>& fn) {
      constexpr int kCalls = 10;
      meet();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kCalls; ++i) fn(i);
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      EPX_CUDA_CHECK(cudaDeviceSynchronize());
      meet();
      return us / kCalls;
    };
    const double t_prep = timed([&](int) { Handle h = prepare(g, idx, w); });
    const double t_pd = timed([&](int) {
      Handle h = prepare(g, idx, w);
      dispatch_forward(g, h, x, w, recv, rw);
    });
    Handle h = prepare(g, idx, w);
    dispatch_forward(g, h, x, w, recv, rw);
    const double t_comb = timed([&](int) { combine_forward(g, h, recv, rw, out); });
    const double host_prep = host_enqueue([&](int) { Handle hh = prepare(g, idx, w); });
    const double host_pd = host_enqueue([&](int) {
      Handle hh = prepare(g, idx, w);
      dispatch_forward(g, hh, x, w, recv, rw);
    });
    const double host_comb = host_enqueue([&](int) { combine_forward(g, h, recv, rw, out); });
    g.check();
    // combine_backward weighted: d_out to every expert row times its weight, the weights' gradient
    // from y = recv; and unweighted, as the layer calls it by default.
    Tensor d_y = Tensor::empty({cap, H}, DType::kBF16, dev), d_rw = Tensor::empty({cap}, DType::kF32, dev);
    const double t_cbwd = timed([&](int) { combine_backward(g, h, out, recv, rw, d_y, d_rw); });
    const double t_cbwd_u =
        timed([&](int) { combine_backward(g, h, out, TensorRef(), TensorRef(), d_y, TensorRef()); });
    g.check();
    // The same two ops replayed from a CUDA graph: what a caller that captures its step sees, without
    // the host's launch cost (which the eager timings above include: ~2 launches per op).
    // A handle is dispatched once, so the dispatch graph prepares each time; the prepare-only graph's
    // time is subtracted. (Exact staged sizes cannot capture prepare: -1.)
    const bool capturable = !g.config().staged_exact_sizes;
    const double g_pd = !capturable ? -1 : graph_us(meet, [&](cudaStream_t s) {
      Handle hh = prepare(g, idx, w, {}, Stream{s});
      dispatch_forward(g, hh, x, w, recv, rw, Stream{s});
    });
    const double g_prep =
        !capturable ? -1 : graph_us(meet, [&](cudaStream_t s) { Handle hh = prepare(g, idx, w, {}, Stream{s}); });
    const double g_disp = capturable ? g_pd - g_prep : -1;
    const double g_comb = graph_us(meet, [&](cudaStream_t s) { combine_forward(g, h, recv, rw, out, Stream{s}); });
    g.check();
    // FP8 dispatch (1x128 recipe: e4m3 rows and H/128 fp32 scales travel together), of an x already
    // quantized, and quantized on the way from the bf16 x.
    Tensor x8 = Tensor::zeros({T, H}, DType::kF8E4M3, dev);
    Tensor xs = Tensor::full({T, H / 128}, DType::kF32, 1.0).to(dev);
    Tensor recv8 = Tensor::empty({cap, H}, DType::kF8E4M3, dev), rs = Tensor::empty({cap, H / 128}, DType::kF32, dev);
    const double t_pd8 = timed([&](int) {
      Handle hh = prepare(g, idx, w);
      dispatch_forward(g, hh, x8, xs, w, recv8, rs, rw);
    });
    const double t_pdq = timed([&](int) {
      Handle hh = prepare(g, idx, w);
      dispatch_forward(g, hh, x, TensorRef(), w, recv8, rs, rw);
    });
    const double g_pd8 = !capturable ? -1 : graph_us(meet, [&](cudaStream_t s) {
      Handle hh = prepare(g, idx, w, {}, Stream{s});
      dispatch_forward(g, hh, x8, xs, w, recv8, rs, rw, Stream{s});
    });
    g.check();
    // Built with -DEPX_EP_TIMELINE=ON: the phases of the last of a few warm zero-copy dispatches and
    // combines, per block.
    if (comm::ep_timeline_enabled() && g.transport() == Transport::kZeroCopy) {
      meet();
      comm::ep_timeline_clear_dispatch();
      comm::ep_timeline_clear_combine();
      meet();
      for (int rep = 0; rep < 5; ++rep) {
        Handle hh = prepare(g, idx, w);
        dispatch_forward(g, hh, x, w, recv, rw);
        combine_forward(g, hh, recv, rw, out);
      }
      comm::EpTimeline td, tc;
      std::vector<JsonLine>& mine = timelines[g.rank()];
      if (comm::ep_timeline_read_dispatch(td)) mine.push_back(timeline_line("dispatch_timeline", g.rank(), T, H, td));
      if (comm::ep_timeline_read_combine(tc)) mine.push_back(timeline_line("combine_timeline", g.rank(), T, H, tc));
      meet();
      g.check();
    }
    Tensor sent = Tensor::wrap(h.state().send_tokens.ref(), nullptr).to(Device::cpu());
    Tensor got = Tensor::wrap(h.state().recv_tokens.ref(), nullptr).to(Device::cpu());
    double remote_rows = 0, all_recv = 0;
    for (int d = 0; d < R; ++d) {
      if (d != g.rank()) remote_rows += sent.ptr<int32_t>()[d];
      all_recv += got.ptr<int32_t>()[d];
    }
    const double t_disp = t_pd - t_prep, row = 2.0 * H, row8 = H + 4.0 * (H / 128);
    auto of_link = [&](double gb_per_s) { return link > 0 ? gb_per_s / link : -1.0; };
    // Bytes this rank's dispatch sends to other ranks: the rows it needs, or on the staged
    // transport the fixed worst case (a whole region per peer, rows and metadata).
    // (exact staged sizes: only the slots each peer needs, rows and metadata)
    const double slot_bytes = (2 * H + 15) / 16 * 16 + K * 16.0;
    const double wire = g.transport() != Transport::kStaged ? remote_rows * row
                        : g.config().staged_exact_sizes ? remote_rows * slot_bytes
                                                        : (R - 1) * static_cast<double>(T) * slot_bytes;
    lines[g.rank()]
        .add("impl", "epx")
        .add("op", "dispatch+combine")
        .add("transport", transport_name(g.transport()))
        .add("staged_exact_sizes", g.config().staged_exact_sizes)
        .add("rank", g.rank())
        .add("ranks", R)
        .add("launch", launched ? "process_per_gpu" : "one_process_thread_per_gpu")
        .add("tokens", T)
        .add("hidden", H)
        .add("experts", E)
        .add("topk", K)
        .add("sm_budget", cfg.num_sms)
        .add("sms_used_at_most", cfg.num_sms > 0 ? cfg.num_sms : sm_count_of(g.device().index))
        .add("prepare_us", t_prep)
        .add("dispatch_us", t_disp)
        .add("combine_us", t_comb)
        .add("combine_backward_us", t_cbwd)
        .add("combine_backward_unweighted_us", t_cbwd_u)
        .add("prepare_host_us", host_prep)
        .add("dispatch_host_us", host_pd - host_prep)
        .add("combine_host_us", host_comb)
        .add("prepare_graph_us", g_prep)
        .add("dispatch_graph_us", g_disp)
        .add("combine_graph_us", g_comb)
        .add("remote_rows", remote_rows)
        .add("dispatch_remote_gb_per_s", remote_rows * row / t_disp * 1e-3)
        .add("dispatch_link_fraction", of_link(remote_rows * row / t_disp * 1e-3))
        .add("dispatch_nvl_gb_per_s", all_recv * row / t_disp * 1e-3)
        .add("combine_remote_gb_per_s", remote_rows * row / t_comb * 1e-3)
        .add("combine_link_fraction", of_link(remote_rows * row / t_comb * 1e-3))
        .add("fp8_dispatch_us", t_pd8 - t_prep)
        .add("fp8_dispatch_graph_us", capturable ? g_pd8 - g_prep : -1)
        .add("fp8_quantizing_dispatch_us", t_pdq - t_prep)
        .add("fp8_dispatch_remote_gb_per_s", remote_rows * row8 / (t_pd8 - t_prep) * 1e-3)
        .add("fp8_dispatch_link_fraction", of_link(remote_rows * row8 / (t_pd8 - t_prep) * 1e-3))
        .add("dispatch_wire_bytes", wire)
        .add("dispatch_wire_gb_per_s", wire / t_disp * 1e-3)
        .add("registered_bytes", static_cast<long long>(g.registered_bytes()))
        .add("recv_capacity_rows", static_cast<long long>(cap));
  });
  for (const Group& g : groups)  // rank 0's line, from the process that holds rank 0
    if (g.rank() == 0) lines[0].print();
  for (const auto& per_rank : timelines)
    for (const JsonLine& l : per_rank) l.print();
}

}  // namespace

int main(int argc, char** argv) {
  int T = 0, H = 0, E = 0, K = 0, sms = 32;
  std::vector<Transport> transports = {Transport::kZeroCopy, Transport::kStaged};
  // A number option that is not a whole number >= 0 is an error naming it (atoi would read it as 0).
  auto number = [](const char* name, const char* text, int& out) {
    if (detail::parse_int(text, out) && out >= 0) return true;
    std::fprintf(stderr, "bench_ep: %s is \"%s\", expected a whole number >= 0\n", name, text);
    return false;
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    bool ok = true;
    if (!std::strcmp(argv[i], "--tokens")) ok = number("--tokens", argv[i + 1], T);
    else if (!std::strcmp(argv[i], "--hidden")) ok = number("--hidden", argv[i + 1], H);
    else if (!std::strcmp(argv[i], "--experts")) ok = number("--experts", argv[i + 1], E);
    else if (!std::strcmp(argv[i], "--topk")) ok = number("--topk", argv[i + 1], K);
    else if (!std::strcmp(argv[i], "--sms")) ok = number("--sms", argv[i + 1], sms);
    else if (!std::strcmp(argv[i], "--transport")) {
      const std::string v = argv[i + 1];
      if (v == "both") transports = {Transport::kZeroCopy, Transport::kStaged};
      else if (v == "zerocopy" || v == "zero-copy") transports = {Transport::kZeroCopy};
      else if (v == "staged") transports = {Transport::kStaged};
      else {
        std::fprintf(stderr, "bench_ep: --transport is \"%s\", expected zerocopy, staged or both\n", v.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "bench_ep: unknown option \"%s\"\n", argv[i]);
      return 2;
    }
    if (!ok) return 2;
  }
  detail::LauncherEnv launcher;
  try {  // the launcher's variables: torchrun's, mpirun's, srun's (a bad value names the variable)
    launcher = detail::launcher_env("bench_ep");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ep: %s\n", e.what());
    return 2;
  }
  const bool launched = launcher.launched;
  const int gpus = detail::cuda_device_count();
  const int ranks = launched ? launcher.world : gpus;
  if (ranks < 2) {
    std::fprintf(stderr, "bench_ep: needs 2 ranks, %d %s: skipped\n", ranks, launched ? "launched" : "GPUs visible");
    return 0;
  }
  try {
    // The copy engine's GPU 0 -> 1 rate, where this process sees both (under a launcher: rank 0's
    // process, before it joins the group); 0 (and link fractions of -1) where it cannot be measured.
    const bool measure = gpus >= 2 && launcher.rank == 0;
    const double link = measure ? peer_copy_gb_per_s() : 0.0;
    if (measure) JsonLine().add("impl", "epx").add("op", "peer_copy_engine").add("gb_per_s", link).print();
    for (Transport tr : transports) {
      if (T) {
        run(T, H ? H : 7168, E ? E : 256, K ? K : 8, sms, link, tr, launched);
      } else {
        for (int h : {7168, 4096})
          for (int t : {128, 512, 2048, 4096, 8192}) run(t, h, h == 7168 ? 256 : 64, 8, sms, link, tr, launched);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ep: %s\n", e.what());
    return 1;
  }
  return 0;
}
