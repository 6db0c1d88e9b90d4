// The reference EP backend: R ranks as threads of one process, each with its own data, talking only
// through the shared windows of a SimWorld, exactly as the zero-copy GPU kernels talk through NCCL
// symmetric windows. Every collective op is "barrier (peers done reading) -> write into peers'
// windows -> barrier (data visible) -> read my window".
//
// Arithmetic contract (the GPU kernels match it bit for bit):
//   combine partial  p_r[t] = round_dtype( fma-chain over k ascending of w_row * y[row] in fp32 )
//   combine result   out[t] = round_dtype( sum over ranks r ascending of p_r[t] in fp32 )
//   combine_backward d_y[row] = round_dtype(w_row * d_out[t]); d_w[row] = sum_h d_out*y (fp32)
//   dispatch_backward like combine, unweighted; d_topk_weights copied back exactly.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "core/ep_state.h"
#include "core/window_layout.h"
#include "epx/error.h"
#include "ref/sim_world.h"

namespace epx {
namespace ref {
namespace {

int64_t read_id(const TensorRef& idx, int64_t i) {
  return idx.dtype() == DType::kI64 ? idx.ptr<int64_t>()[i] : idx.ptr<int32_t>()[i];
}

// Routing after validation and capacity dropping. Invalid slots are treated as masked for data
// movement and reported (first one) through `bad`.
std::vector<int32_t> kept_routing(const TensorRef& idx, const TensorRef& weights, int E, int capacity,
                                  DropPolicy policy, std::string& bad) {
  const int64_t T = idx.size(0), K = idx.size(1);
  std::vector<int32_t> routed(static_cast<size_t>(T * K), -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      int64_t e = read_id(idx, t * K + k);
      if (e == -1) continue;
      if (e < 0 || e >= E) {
        if (bad.empty())
          bad = detail::concat("topk_idx[", t, ", ", k, "] is ", e, ", expected -1 (masked) or an expert id in [0, ", E, ")");
        continue;
      }
      bool repeated = false;
      for (int64_t k2 = 0; k2 < k; ++k2) repeated |= read_id(idx, t * K + k2) == e;
      if (repeated) {
        if (bad.empty())
          bad = detail::concat("topk_idx row ", t, " names expert ", e, " twice (slot ", k,
                               "); each token picks distinct experts");
        continue;
      }
      routed[t * K + k] = static_cast<int32_t>(e);
    }
  if (capacity <= 0) return routed;

  if (policy == DropPolicy::kByPosition) {
    std::vector<int> taken(E, 0);
    for (auto& e : routed)
      if (e >= 0 && taken[e]++ >= capacity) e = -1;
    return routed;
  }
  // By probability: per expert, the `capacity` largest weights survive; ties (and NaN, which ranks
  // last) fall back to position so the choice is deterministic.
  std::vector<std::vector<int64_t>> pairs(E);
  for (int64_t p = 0; p < T * K; ++p)
    if (routed[p] >= 0) pairs[routed[p]].push_back(p);
  auto key = [&](int64_t p) {
    const double w = load_as_double(weights.data(), weights.dtype(), p);
    return std::isnan(w) ? -INFINITY : w;
  };
  for (int e = 0; e < E; ++e) {
    auto& v = pairs[e];
    if (static_cast<int>(v.size()) <= capacity) continue;
    std::stable_sort(v.begin(), v.end(), [&](int64_t a, int64_t b) { return key(a) > key(b); });
    for (size_t i = capacity; i < v.size(); ++i) routed[v[i]] = -1;
  }
  return routed;
}

class HostGroup final : public GroupState {
 public:
  HostGroup(std::shared_ptr<SimWorld> world, int rank, int size, const GroupConfig& c) : world_(std::move(world)) {
    config = c;
    this->rank = rank;
    this->size = size;
    local_experts = c.num_experts / size;
    device = Device::cpu();
    transport = Transport::kHost;
    recv_capacity_rows = c.recv_capacity_rows > 0 ? c.recv_capacity_rows : worst_case_recv_rows(c, size);
    registered_bytes = world_->layout.total;
    timeout_s_ = resolved_timeout_s(c);
  }

  void prepare(HandleState& h, const TensorRef& topk_idx, const TensorRef& topk_weights,
               const PrepareOptions& options, Stream) override {
    const char* fn = "epx::prepare";
    const int T = h.num_tokens, K = h.topk, E = h.num_experts, R = size, Le = local_experts;
    const WindowLayout& L = world_->layout;

    std::string bad;
    std::vector<int32_t> routed = kept_routing(topk_idx, topk_weights, E, h.capacity, options.drop_policy, bad);

    h.routed_experts = Tensor::empty({T, K}, DType::kI32);
    h.pair_pos = Tensor::empty({T, K}, DType::kI32);
    h.token_slot = Tensor::empty({T, R}, DType::kI32);
    h.send_tokens = Tensor::zeros({R}, DType::kI32);
    h.routed_counts = Tensor::zeros({E}, DType::kI32);
    std::copy(routed.begin(), routed.end(), h.routed_experts.ptr<int32_t>());
    int32_t* pos = h.pair_pos.ptr<int32_t>();
    int32_t* counts = h.routed_counts.ptr<int32_t>();
    int32_t* slot = h.token_slot.ptr<int32_t>();
    int32_t* send = h.send_tokens.ptr<int32_t>();
    for (int t = 0; t < T; ++t) {
      std::vector<char> to_rank(R, 0);
      for (int k = 0; k < K; ++k) {
        const int e = routed[t * K + k];
        pos[t * K + k] = e >= 0 ? counts[e]++ : -1;
        if (e >= 0) to_rank[e / Le] = 1;
      }
      for (int d = 0; d < R; ++d) slot[t * R + d] = to_rank[d] ? send[d]++ : -1;
    }

    // Exchange: my pairs per expert of rank d, my token rows for d, and my top-k, into d's header.
    // As on the zero-copy transport, prepares alternate between two header copies, so no barrier
    // comes before the writes: a peer passed the previous prepare's barrier, so it has finished
    // reading the copy written here (the one before that).
    const int parity = static_cast<int>(prepares_++ & 1u);
    for (int d = 0; d < R; ++d) {
      int32_t* hdr = reinterpret_cast<int32_t*>(world_->window(d) + L.header_offset(rank, parity));
      for (int j = 0; j < Le; ++j) hdr[j] = counts[d * Le + j];
      hdr[Le] = send[d];
      hdr[Le + 1] = K;
    }
    world_->barrier.arrive_and_wait(rank, fn, timeout_s_);

    h.recv_pairs = Tensor::empty({R, Le}, DType::kI32);
    h.recv_tokens = Tensor::empty({R}, DType::kI32);
    h.expert_rows = Tensor::zeros({Le}, DType::kI32);
    h.expert_offsets = Tensor::zeros({Le + 1}, DType::kI32);
    h.status = Tensor::zeros({4}, DType::kI32);
    h.status.ptr<int32_t>()[1] = kNoBadPair;
    std::string topk_mismatch;
    for (int s = 0; s < R; ++s) {
      const int32_t* hdr = reinterpret_cast<const int32_t*>(world_->window(rank) + L.header_offset(s, parity));
      for (int j = 0; j < Le; ++j) {
        h.recv_pairs.ptr<int32_t>()[s * Le + j] = hdr[j];
        h.expert_rows.ptr<int32_t>()[j] += hdr[j];
      }
      h.recv_tokens.ptr<int32_t>()[s] = hdr[Le];
      if (hdr[Le + 1] != K && topk_mismatch.empty())
        topk_mismatch = detail::concat("rank ", s, " prepared with top-k ", hdr[Le + 1], ", this rank with ", K,
                                       " (every rank must prepare the same layer)");
    }
    int64_t total = 0;
    for (int j = 0; j < Le; ++j) {
      h.expert_offsets.ptr<int32_t>()[j] = static_cast<int32_t>(total);
      total += round_up(h.expert_rows.ptr<int32_t>()[j], config.align);
    }
    h.expert_offsets.ptr<int32_t>()[Le] = static_cast<int32_t>(std::min<int64_t>(total, INT32_MAX));
    h.status.ptr<int32_t>()[0] = total > h.recv_capacity ? static_cast<int32_t>(total - h.recv_capacity) : 0;
    h.recv_row = Tensor::empty({R, h.max_tokens, K}, DType::kI32);
    std::fill_n(h.recv_row.ptr<int32_t>(), h.recv_row.numel(), -1);

    require(bad.empty(), fn, bad);
    require(topk_mismatch.empty(), fn, topk_mismatch);
  }

  void dispatch_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& topk_weights,
                        const TensorRef& recv_x, const TensorRef& recv_scales, const TensorRef& recv_weights,
                        Stream) override {
    const char* fn = "epx::dispatch_forward";
    const int T = h.num_tokens, K = h.topk, R = size, Le = local_experts;
    const WindowLayout& L = world_->layout;
    const size_t row_bytes = static_cast<size_t>(config.hidden) * dtype_size(x.dtype());
    // Quantized rows carry their scales right after the payload in the same window row.
    const size_t scale_bytes = x_scales.defined() ? static_cast<size_t>(x_scales.size(1)) * dtype_size(x_scales.dtype()) : 0;
    const int32_t* routed = h.routed_experts.ptr<int32_t>();
    const int32_t* pos = h.pair_pos.ptr<int32_t>();
    const int32_t* slot = h.token_slot.ptr<int32_t>();

    world_->barrier.arrive_and_wait(rank, fn, timeout_s_);
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < R; ++d) {
        const int sl = slot[t * R + d];
        if (sl < 0) continue;
        char* win = world_->window(d);
        std::memcpy(win + L.row_offset(rank, sl), static_cast<const char*>(x.data()) + t * row_bytes, row_bytes);
        if (scale_bytes)
          std::memcpy(win + L.row_offset(rank, sl) + row_bytes, static_cast<const char*>(x_scales.data()) + t * scale_bytes,
                      scale_bytes);
        RowMeta* meta = reinterpret_cast<RowMeta*>(win + L.meta_offset(rank, sl));
        for (int k = 0; k < K; ++k) {
          const int e = routed[t * K + k];
          const bool here = e >= 0 && e / Le == d;
          const double w = here && topk_weights.defined() ? load_as_double(topk_weights.data(), topk_weights.dtype(), t * K + k) : 0.0;
          meta[k] = RowMeta{here ? e % Le : -1, here ? pos[t * K + k] : 0, w};
        }
      }
    world_->barrier.arrive_and_wait(rank, fn, timeout_s_);

    const int32_t overflow = h.status.ptr<int32_t>()[0];
    require_status(overflow == 0, Status::kCapacityExceeded, fn,
                   recv_overflow_message(rank, h.recv_capacity + overflow, h.recv_capacity, recv_capacity_rows));
    zero_padding(h, recv_x, recv_weights);
    if (scale_bytes) zero_padding(h, recv_scales, {});
    std::vector<int64_t> seg = source_segment_starts(h);
    int32_t* recv_row = h.recv_row.ptr<int32_t>();
    const char* win = world_->window(rank);
    for (int s = 0; s < R; ++s)
      for (int sl = 0; sl < h.recv_tokens.ptr<int32_t>()[s]; ++sl) {
        const RowMeta* meta = reinterpret_cast<const RowMeta*>(win + L.meta_offset(s, sl));
        for (int k = 0; k < K; ++k) {
          if (meta[k].local_expert < 0) continue;
          const int64_t row = seg[meta[k].local_expert * R + s] + meta[k].position;
          std::memcpy(static_cast<char*>(recv_x.data()) + row * row_bytes, win + L.row_offset(s, sl), row_bytes);
          if (scale_bytes)
            std::memcpy(static_cast<char*>(recv_scales.data()) + row * scale_bytes, win + L.row_offset(s, sl) + row_bytes,
                        scale_bytes);
          if (recv_weights.defined()) store_from_double(recv_weights.data(), recv_weights.dtype(), row, meta[k].weight);
          recv_row[(static_cast<int64_t>(s) * h.max_tokens + sl) * K + k] = static_cast<int32_t>(row);
        }
      }
  }

  void combine_forward(HandleState& h, const TensorRef& y, const TensorRef& row_weights, const TensorRef& out,
                       Stream) override {
    const char* fn = "epx::combine_forward";
    if (y.dtype() == DType::kF64) {
      reduce_to_sources<double>(h, fn, y, row_weights, {});
      sum_partials<double>(h, out);
    } else {
      reduce_to_sources<float>(h, fn, y, row_weights, {});
      sum_partials<float>(h, out);
    }
  }

  void combine_backward(HandleState& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& row_weights,
                        const TensorRef& d_y, const TensorRef& d_row_weights, Stream) override {
    send_token_rows(h, "epx::combine_backward", d_out);
    zero_padding(h, d_y, d_row_weights);
    if (d_out.dtype() == DType::kF64)
      expand_gradients<double>(h, d_out.dtype(), y, row_weights, d_y, d_row_weights);
    else
      expand_gradients<float>(h, d_out.dtype(), y, row_weights, d_y, d_row_weights);
  }

  void dispatch_backward(HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                         const TensorRef& d_x, const TensorRef& d_topk_weights, Stream) override {
    const char* fn = "epx::dispatch_backward";
    if (d_recv_x.dtype() == DType::kF64) {
      reduce_to_sources<double>(h, fn, d_recv_x, {}, d_recv_weights);
      sum_partials<double>(h, d_x);
    } else {
      reduce_to_sources<float>(h, fn, d_recv_x, {}, d_recv_weights);
      sum_partials<float>(h, d_x);
    }
    if (!d_topk_weights.defined()) return;
    const int T = h.num_tokens, K = h.topk, R = size, Le = local_experts;
    const WindowLayout& L = world_->layout;
    const int32_t* routed = h.routed_experts.ptr<int32_t>();
    const int32_t* slot = h.token_slot.ptr<int32_t>();
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const int e = routed[t * K + k];
        double v = 0;
        if (e >= 0) {
          const int d = e / Le;
          v = reinterpret_cast<const RowMeta*>(world_->window(rank) + L.meta_offset(d, slot[t * R + d]))[k].weight;
        }
        store_from_double(d_topk_weights.data(), d_topk_weights.dtype(), t * K + k, v);
      }
  }

  void all_reduce_sum(const TensorRef& buffer, Stream) override {
    const char* fn = "epx::all_reduce_sum";
    const WindowLayout& L = world_->layout;
    const size_t es = dtype_size(buffer.dtype());
    const int64_t chunk = static_cast<int64_t>(WindowLayout::kReduceBytes / es);
    // Every rank runs the same number of rounds (one at least) so the barriers pair up.
    const int64_t rounds = std::max<int64_t>(1, (buffer.numel() + chunk - 1) / chunk);
    for (int64_t round = 0; round < rounds; ++round) {
      const int64_t begin = round * chunk, n = std::min<int64_t>(chunk, buffer.numel() - begin);
      world_->barrier.arrive_and_wait(rank, fn, timeout_s_);
      for (int d = 0; d < size; ++d)
        std::memcpy(world_->window(d) + L.reduce_offset(rank), static_cast<char*>(buffer.data()) + begin * es, n * es);
      world_->barrier.arrive_and_wait(rank, fn, timeout_s_);
      for (int64_t i = 0; i < n; ++i) {
        if (buffer.dtype() == DType::kF64) {
          double acc = 0;
          for (int s = 0; s < size; ++s) acc += reinterpret_cast<const double*>(world_->window(rank) + L.reduce_offset(s))[i];
          buffer.ptr<double>()[begin + i] = acc;
        } else {
          float acc = 0;
          for (int s = 0; s < size; ++s) acc += reinterpret_cast<const float*>(world_->window(rank) + L.reduce_offset(s))[i];
          buffer.ptr<float>()[begin + i] = acc;
        }
      }
    }
  }

  void check() override {}

 private:
  // Start row of source s's run inside local expert j's segment, at [j * R + s].
  std::vector<int64_t> source_segment_starts(const HandleState& h) const {
    const int R = size, Le = local_experts;
    std::vector<int64_t> seg(static_cast<size_t>(Le) * R);
    for (int j = 0; j < Le; ++j) {
      int64_t at = h.expert_offsets.ptr<int32_t>()[j];
      for (int s = 0; s < R; ++s) {
        seg[j * R + s] = at;
        at += h.recv_pairs.ptr<int32_t>()[s * Le + j];
      }
    }
    return seg;
  }

  void zero_padding(const HandleState& h, const TensorRef& rows_out, const TensorRef& per_row) const {
    const size_t row_bytes = static_cast<size_t>(rows_out.numel() / rows_out.size(0)) * dtype_size(rows_out.dtype());
    const int32_t* off = h.expert_offsets.ptr<int32_t>();
    const int32_t* rows = h.expert_rows.ptr<int32_t>();
    for (int j = 0; j < local_experts; ++j) {
      std::memset(static_cast<char*>(rows_out.data()) + (off[j] + rows[j]) * row_bytes, 0,
                  (off[j + 1] - off[j] - rows[j]) * row_bytes);
      if (per_row.defined())
        std::memset(static_cast<char*>(per_row.data()) + (off[j] + rows[j]) * dtype_size(per_row.dtype()), 0,
                    (off[j + 1] - off[j] - rows[j]) * dtype_size(per_row.dtype()));
    }
  }

  // Source side of combine_backward: every token row once per destination rank.
  void send_token_rows(const HandleState& h, const char* fn, const TensorRef& rows_in) {
    const int T = h.num_tokens, R = size;
    const WindowLayout& L = world_->layout;
    const size_t row_bytes = static_cast<size_t>(config.hidden) * dtype_size(rows_in.dtype());
    const int32_t* slot = h.token_slot.ptr<int32_t>();
    world_->barrier.arrive_and_wait(rank, fn, timeout_s_);
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < R; ++d)
        if (slot[t * R + d] >= 0)
          std::memcpy(world_->window(d) + L.row_offset(rank, slot[t * R + d]),
                      static_cast<const char*>(rows_in.data()) + t * row_bytes, row_bytes);
    world_->barrier.arrive_and_wait(rank, fn, timeout_s_);
  }

  // Expert side of combine_backward: d_y[row] = round(w_row * d_out[t]) and
  // d_row_weights[row] = <d_out[t], y[row]> accumulated with fma over h ascending.
  template <class Acc>
  void expand_gradients(const HandleState& h, DType dt, const TensorRef& y, const TensorRef& row_weights,
                        const TensorRef& d_y, const TensorRef& d_row_weights) {
    const int K = h.topk, R = size, H = static_cast<int>(config.hidden);
    const WindowLayout& L = world_->layout;
    const size_t row_bytes = static_cast<size_t>(H) * dtype_size(dt);
    const int32_t* recv_row = h.recv_row.ptr<int32_t>();
    const char* win = world_->window(rank);
    std::vector<Acc> g(H), yv(H), scaled(H);
    for (int s = 0; s < R; ++s)
      for (int sl = 0; sl < h.recv_tokens.ptr<int32_t>()[s]; ++sl) {
        load_row(win + L.row_offset(s, sl), dt, 0, H, g.data());
        for (int k = 0; k < K; ++k) {
          const int32_t row = recv_row[(static_cast<int64_t>(s) * h.max_tokens + sl) * K + k];
          if (row < 0) continue;
          char* dst = static_cast<char*>(d_y.data()) + row * row_bytes;
          if (row_weights.defined()) {
            const Acc wr = static_cast<Acc>(load_as_double(row_weights.data(), row_weights.dtype(), row));
            for (int i = 0; i < H; ++i) scaled[i] = wr * g[i];
            store_row(dst, dt, 0, H, scaled.data());
          } else {
            std::memcpy(dst, win + L.row_offset(s, sl), row_bytes);
          }
          if (d_row_weights.defined()) {
            load_row(y.data(), y.dtype(), static_cast<int64_t>(row) * H, H, yv.data());
            Acc acc = 0;
            for (int i = 0; i < H; ++i) acc = std::fma(g[i], yv[i], acc);
            store_from_double(d_row_weights.data(), d_row_weights.dtype(), row, acc);
          }
        }
      }
  }

  // Expert side of combine / dispatch_backward: one partial row per received (source, token),
  // accumulated over the token's slots in ascending order (fma with the row weight when weighted)
  // and written, in the rows' dtype, into the source's window; per-row scalars (weight gradients)
  // travel back in the meta.
  template <class Acc>
  void reduce_to_sources(const HandleState& h, const char* fn, const TensorRef& rows_in, const TensorRef& row_weights,
                         const TensorRef& row_scalars) {
    const int K = h.topk, R = size, H = static_cast<int>(config.hidden);
    const WindowLayout& L = world_->layout;
    const DType dt = rows_in.dtype();
    const int32_t* recv_row = h.recv_row.ptr<int32_t>();
    std::vector<Acc> acc(H), v(H);
    world_->barrier.arrive_and_wait(rank, fn, timeout_s_);
    for (int s = 0; s < R; ++s)
      for (int sl = 0; sl < h.recv_tokens.ptr<int32_t>()[s]; ++sl) {
        std::fill(acc.begin(), acc.end(), Acc(0));
        char* win = world_->window(s);
        RowMeta* meta = reinterpret_cast<RowMeta*>(win + L.meta_offset(rank, sl));
        for (int k = 0; k < K; ++k) {
          const int32_t row = recv_row[(static_cast<int64_t>(s) * h.max_tokens + sl) * K + k];
          if (row < 0) continue;
          load_row(rows_in.data(), dt, static_cast<int64_t>(row) * H, H, v.data());
          if (row_weights.defined()) {
            const Acc w = static_cast<Acc>(load_as_double(row_weights.data(), row_weights.dtype(), row));
            for (int i = 0; i < H; ++i) acc[i] = std::fma(w, v[i], acc[i]);
          } else {
            for (int i = 0; i < H; ++i) acc[i] += v[i];
          }
          if (row_scalars.defined()) meta[k].weight = load_as_double(row_scalars.data(), row_scalars.dtype(), row);
        }
        store_row(win + L.row_offset(rank, sl), dt, 0, H, acc.data());
      }
    world_->barrier.arrive_and_wait(rank, fn, timeout_s_);
  }

  // Source side: out[t] = sum over ranks in ascending order of the partials that came back.
  template <class Acc>
  void sum_partials(const HandleState& h, const TensorRef& out) {
    const int T = h.num_tokens, R = size, H = static_cast<int>(config.hidden);
    const WindowLayout& L = world_->layout;
    const int32_t* slot = h.token_slot.ptr<int32_t>();
    std::vector<Acc> acc(H), v(H);
    for (int t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (int d = 0; d < R; ++d) {
        if (slot[t * R + d] < 0) continue;
        load_row(world_->window(rank) + L.row_offset(d, slot[t * R + d]), out.dtype(), 0, H, v.data());
        for (int i = 0; i < H; ++i) acc[i] += v[i];
      }
      store_row(out.data(), out.dtype(), static_cast<int64_t>(t) * H, H, acc.data());
    }
  }

  std::shared_ptr<SimWorld> world_;
  double timeout_s_ = 10.0;
  uint32_t prepares_ = 0;  // its parity picks the header copy
};

}  // namespace
}  // namespace ref

std::vector<Group> Group::create_simulated(int num_ranks, const GroupConfig& config) {
  config.validate("epx::Group::create_simulated", num_ranks);
  auto world = std::make_shared<ref::SimWorld>(num_ranks, WindowLayout::make(config, num_ranks));
  std::vector<Group> groups;
  for (int r = 0; r < num_ranks; ++r) {
    auto s = std::make_unique<ref::HostGroup>(world, r, num_ranks, config);
    s->id = next_group_id();
    groups.push_back(Group(std::move(s)));
  }
  return groups;
}

}  // namespace epx
