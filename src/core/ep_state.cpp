// Members of the public Group and Handle, and the group configuration checks.
#include "core/ep_state.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "core/device_memory.h"
#include "core/env_choice.h"
#include "core/env_names.h"
#include "core/window_layout.h"
#include "epx/error.h"

namespace epx {

const char* transport_name(Transport t) {
  switch (t) {
    case Transport::kAuto: return "auto";
    case Transport::kZeroCopy: return "zero-copy";
    case Transport::kStaged: return "staged";
    case Transport::kHost: return "host";
    case Transport::kLocal: return "local";
  }
  return "?";
}

void GroupConfig::validate(const char* fn, int num_ranks) const {
  detail::warn_unknown_env_names_once();  // every group is made through here
  require(num_ranks >= 1, fn, "the group has ", num_ranks, " ranks, expected >= 1");
  require(num_experts >= 1, fn, "config.num_experts is ", num_experts, ", expected >= 1");
  require(num_experts % num_ranks == 0, fn, "config.num_experts is ", num_experts,
          ", expected a multiple of the group size ", num_ranks);
  require(hidden >= 1, fn, "config.hidden is ", hidden, ", expected >= 1");
  require(max_tokens_per_rank >= 1, fn, "config.max_tokens_per_rank is ", max_tokens_per_rank, ", expected >= 1");
  require(max_topk >= 1 && max_topk <= 64, fn, "config.max_topk is ", max_topk, ", expected 1..64");
  require(align >= 1 && align <= 1024 && (align & (align - 1)) == 0, fn, "config.align is ", align,
          ", expected a power of two in [1, 1024] (1, 16, 32 and 128 are the usual ones)");
  require(max_dtype == DType::kBF16 || max_dtype == DType::kF16 || max_dtype == DType::kF32 ||
              max_dtype == DType::kF64 || max_dtype == DType::kF8E4M3 || max_dtype == DType::kF8E5M2,
          fn, "config.max_dtype is ", dtype_name(max_dtype),
          ", expected a payload dtype (fp32, bf16, fp16, fp8; fp64 on the reference backend)");
  require(recv_capacity_rows >= 0, fn, "config.recv_capacity_rows is ", recv_capacity_rows, ", expected >= 0");
  require(num_sms >= 0, fn, "config.num_sms is ", num_sms, ", expected >= 0 (0 = auto)");
  require(timeout_s >= 0 && timeout_s <= kMaxTimeoutS, fn, "config.timeout_s is ", timeout_s,
          ", expected 0 (EPX_TIMEOUT_S or 10 s) .. ", kMaxTimeoutS, " seconds");
  resolved_timeout_s(*this);  // a bad EPX_TIMEOUT_S fails here, before any collective call
}

int64_t worst_case_recv_rows(const GroupConfig& c, int num_ranks) {
  const int64_t le = c.num_experts / num_ranks;
  return static_cast<int64_t>(num_ranks) * c.max_tokens_per_rank * std::min<int64_t>(c.max_topk, le) +
         le * (c.align - 1);
}

std::string recv_overflow_message(int rank, int64_t needed, int64_t capacity, int64_t group_capacity) {
  if (capacity == group_capacity)
    return detail::concat("rank ", rank, " would receive ", needed, " expert-major rows, more than the group's recv ",
                          "capacity of ", capacity, " (raise GroupConfig::recv_capacity_rows or leave it 0 for the ",
                          "worst case); nothing was written");
  return detail::concat("rank ", rank, " would receive ", needed, " expert-major rows, more than its handle's recv ",
                        "capacity of ", capacity, " (PrepareOptions::recv_capacity_rows; the group's is ",
                        group_capacity, "); nothing was written");
}

double resolved_timeout_s(const GroupConfig& c) {
  if (c.timeout_s > 0) return c.timeout_s;
  return detail::env_positive_number("EPX_TIMEOUT_S", 10.0, kMaxTimeoutS);
}

bool resolved_staged_exact_sizes(const GroupConfig& c, const char* fn) {
  // The variable is checked even when the config decides: a typo never goes unnoticed.
  bool env_exact = false;
  if (const char* env = std::getenv("EPX_STAGED_SIZES"); env != nullptr && *env != '\0') {
    const std::string v = env;
    if (v != "exact" && v != "fixed")
      throw Error(Status::kInvalidArgument,
                  detail::concat(fn, ": EPX_STAGED_SIZES is \"", v, "\", expected exact or fixed"));
    env_exact = v == "exact";
  }
  return c.staged_exact_sizes || env_exact;
}

Transport parse_transport(const char* value, const char* fn) {
  const std::string v = value ? value : "";
  if (v == "auto") return Transport::kAuto;
  if (v == "zerocopy" || v == "zero-copy") return Transport::kZeroCopy;
  if (v == "staged") return Transport::kStaged;
  throw Error(Status::kInvalidArgument, detail::concat(fn, ": EPX_TRANSPORT is \"", v,
                                                       "\", expected one of auto, zerocopy, staged"));
}

Transport requested_transport(const GroupConfig& c, const char* fn) {
  require(c.transport == Transport::kAuto || c.transport == Transport::kZeroCopy || c.transport == Transport::kStaged,
          fn, "config.transport is ", transport_name(c.transport),
          ", expected auto, zero-copy or staged for an NCCL group (host and local are backends of their own: "
          "Group::create_simulated, Group::create_local)");
  // Read even when the config names the transport, so a bad value never goes unnoticed.
  const char* env = std::getenv("EPX_TRANSPORT");
  const Transport from_env = env ? parse_transport(env, fn) : Transport::kAuto;
  return c.transport != Transport::kAuto ? c.transport : from_env;
}

size_t registered_bytes_per_rank(const GroupConfig& config, int num_ranks, Transport transport) {
  const char* fn = "epx::registered_bytes_per_rank";
  require(num_ranks >= 1, fn, "num_ranks is ", num_ranks, ", expected >= 1");
  config.validate(fn, num_ranks);
  require(transport == Transport::kZeroCopy || transport == Transport::kStaged, fn, "transport is ",
          transport_name(transport), ", expected zero-copy or staged (auto resolves when the group is made)");
  const WindowLayout w = WindowLayout::make(config, num_ranks);
  return transport == Transport::kZeroCopy ? w.window_bytes() : 2 * w.staging_bytes();
}

uint64_t next_group_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

// ---- Group ----------------------------------------------------------------------------------
Group::Group() = default;
Group::~Group() = default;
Group::Group(Group&&) noexcept = default;
Group& Group::operator=(Group&&) noexcept = default;
Group::Group(std::unique_ptr<GroupState> s) : state_(std::move(s)) {}

GroupState& Group::state() const {
  if (!state_) throw Error(Status::kInvalidArgument, "epx::Group: used after move or before creation");
  return *state_;
}
int Group::rank() const { return state().rank; }
int Group::size() const { return state().size; }
int Group::local_experts() const { return state().local_experts; }
const GroupConfig& Group::config() const { return state().config; }
Device Group::device() const { return state().device; }
Transport Group::transport() const { return state().transport; }
int64_t Group::recv_capacity_rows() const { return state().recv_capacity_rows; }
size_t Group::registered_bytes() const { return state().registered_bytes; }
void Group::check() { state().check(); }

void run_ranks(std::vector<Group>& groups, const std::function<void(Group&)>& fn) {
  std::vector<std::exception_ptr> errors(groups.size());
  std::vector<std::thread> threads;
  threads.reserve(groups.size());
  for (size_t r = 0; r < groups.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        fn(groups[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < groups.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const Error& e) {
      throw Error(e.status(), detail::concat("rank ", r, ": ", e.what()));
    } catch (const std::exception& e) {
      throw Error(Status::kInternal, detail::concat("rank ", r, ": ", e.what()));
    }
  }
}

// ---- Handle ---------------------------------------------------------------------------------
Handle::Handle() = default;
Handle::~Handle() = default;
Handle::Handle(Handle&&) noexcept = default;
Handle& Handle::operator=(Handle&&) noexcept = default;
Handle::Handle(std::unique_ptr<HandleState> s) : state_(std::move(s)) {}

HandleState& Handle::state() const {
  if (!state_) throw Error(Status::kInvalidArgument, "epx::Handle: used before prepare() or after move");
  return *state_;
}
int Handle::num_tokens() const { return state().num_tokens; }
int Handle::topk() const { return state().topk; }
int Handle::capacity() const { return state().capacity; }
int64_t Handle::recv_capacity_rows() const { return state().recv_capacity; }
bool Handle::dispatched() const { return state().dispatched; }
const TensorRef& Handle::expert_offsets() const { return state().expert_offsets.ref(); }
const TensorRef& Handle::expert_rows() const { return state().expert_rows.ref(); }
const TensorRef& Handle::routed_counts() const { return state().routed_counts.ref(); }
const TensorRef& Handle::routed_experts() const { return state().routed_experts.ref(); }

std::vector<int32_t> Handle::expert_offsets_host() const {
  Tensor h = state().expert_offsets.to(Device::cpu());
  return std::vector<int32_t>(h.ptr<int32_t>(), h.ptr<int32_t>() + h.numel());
}

int64_t Handle::num_recv_rows_host() const {
  std::vector<int32_t> o = expert_offsets_host();
  return o.empty() ? 0 : o.back();
}

}  // namespace epx

#ifndef EPX_HAVE_CUDA
namespace epx {
Group Group::create_local(const GroupConfig&, int) {
  throw Error(Status::kNotSupported, "epx::Group::create_local: epx was built without the CUDA backend");
}
std::vector<Group> Group::create_all_local(const GroupConfig&, std::vector<int>) {
  throw Error(Status::kNotSupported, "epx::Group::create_all_local: epx was built without the CUDA backend");
}
Group Group::from_nccl(void*, const GroupConfig&) {
  throw Error(Status::kNotSupported, "epx::Group::from_nccl: epx was built without the CUDA backend");
}
Group Group::create_from_id(const std::string&, int, int, int, const GroupConfig&) {
  throw Error(Status::kNotSupported, "epx::Group::create_from_id: epx was built without the CUDA backend");
}
std::string nccl_unique_id() {
  throw Error(Status::kNotSupported, "epx::nccl_unique_id: epx was built without the CUDA backend");
}
Group Group::create_from_env(const GroupConfig&) {
  throw Error(Status::kNotSupported, "epx::Group::create_from_env: epx was built without the CUDA backend");
}
}  // namespace epx
#endif
