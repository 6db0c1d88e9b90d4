// A group of one rank on one GPU: every expert is local, so dispatch and combine are the local
// permute kernels and nothing crosses a link. Same Handle, same layout, same contracts as the
// multi-rank groups; it is also what a single-GPU MoE layer runs on. Quantize-on-the-way dispatch
// runs fused (one kernel reads x once and writes fp8 rows and scales to every destination).
#include <cuda_runtime_api.h>

#include <memory>
#include <utility>

#include "comm/group_status.h"
#include "comm/handle_pool.h"
#include "core/device_memory.h"
#include "core/ep_state.h"
#include "cuda/common/cuda_check.h"
#include "cuda/layout/layout.h"
#include "cuda/permute/permute.h"
#include "epx/error.h"

namespace epx {
namespace comm {
namespace {

using cuda::DeviceGuard;

class LocalGroup final : public GroupState {
 public:
  LocalGroup(const GroupConfig& c, int dev) {
    config = c;
    rank = 0;
    size = 1;
    local_experts = c.num_experts;
    device = Device::cuda(dev);
    transport = Transport::kLocal;
    recv_capacity_rows = c.recv_capacity_rows > 0 ? c.recv_capacity_rows : worst_case_recv_rows(c, 1);
    id = next_group_id();
    pool_ = std::make_shared<HandlePool>(cuda::handle_block_bytes(c, 1), dev);
    DeviceGuard g(dev);
    status_ = Tensor::empty({5}, DType::kI32, device);
    reset_status();
    fused_quantize_ = cuda::permute_quantize_fits(c.hidden);
  }

  void prepare(HandleState& h, const TensorRef& topk_idx, const TensorRef& topk_weights, const PrepareOptions& options,
               Stream stream) override {
    DeviceGuard g(device.index);
    h.storage = pool_->acquire();
    cuda::bind_handle(h, h.storage.get(), config, 1, 0, device);
    cuda::prepare_send_side(h, topk_idx, topk_weights, options, /*local=*/true, config.align, h.recv_capacity,
                            status_.ptr<int32_t>(), stream);
  }

  void dispatch_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& topk_weights,
                        const TensorRef& recv_x, const TensorRef& recv_scales, const TensorRef& recv_weights,
                        Stream stream) override {
    DeviceGuard g(device.index);
    cuda::permute_forward(h, x, x_scales, topk_weights, recv_x, recv_scales, recv_weights, h.recv_capacity,
                          config.align, stream);
  }

  bool fuses_quantize_dispatch() const override { return fused_quantize_; }

  void dispatch_forward_quantize(HandleState& h, QuantRecipe recipe, E8M0Rounding mx_rounding, const TensorRef& x,
                                 const TensorRef& topk_weights, const TensorRef& recv_x, const TensorRef& recv_scales,
                                 const TensorRef& recv_weights, Stream stream) override {
    DeviceGuard g(device.index);
    cuda::permute_quantize_forward(h, recipe, mx_rounding, x, topk_weights, recv_x, recv_scales, recv_weights,
                                   h.recv_capacity, config.align, stream);
  }

  void combine_forward(HandleState& h, const TensorRef& y, const TensorRef& row_weights, const TensorRef& out,
                       Stream stream) override {
    DeviceGuard g(device.index);
    cuda::unpermute_forward(h, y, row_weights, out, stream);
  }

  void combine_backward(HandleState& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& row_weights,
                        const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream) override {
    DeviceGuard g(device.index);
    cuda::permute_backward(h, d_out, y, row_weights, d_y, d_row_weights, stream);
  }

  void dispatch_backward(HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                         const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream) override {
    DeviceGuard g(device.index);
    cuda::unpermute_backward(h, d_recv_x, d_recv_weights, d_x, d_topk_weights, stream);
  }

  void all_reduce_sum(const TensorRef&, Stream) override {}  // one rank: the sum is the buffer

  void reserve_handles(size_t handles) override { pool_->reserve(handles); }
  void check() override {
    DeviceGuard g(device.index);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    int32_t s[5];
    EPX_CUDA_CHECK(cudaMemcpy(s, status_.data(), sizeof s, cudaMemcpyDeviceToHost));
    reset_status();
    raise_layout_status(s, 0, config.num_experts, recv_capacity_rows,
                        std::exchange(smaller_handle_capacity, false));
  }

 private:
  void reset_status() {
    const int32_t init[5] = {0, kNoBadPair, 0, 0, 0};
    EPX_CUDA_CHECK(cudaMemcpy(status_.data(), init, sizeof init, cudaMemcpyHostToDevice));
  }

  std::shared_ptr<HandlePool> pool_;
  Tensor status_;
  bool fused_quantize_ = false;  // the fused kernel's shared-memory stages fit rows of `hidden`
};

}  // namespace
}  // namespace comm

Group Group::create_local(const GroupConfig& config, int device) {
  config.validate("epx::Group::create_local", 1);
  const int n = detail::cuda_device_count();
  require(device >= 0 && device < n, "epx::Group::create_local", "device is ", device, ", expected 0..", n - 1, " (",
          n, " CUDA device(s) visible)");
  return Group(std::make_unique<comm::LocalGroup>(config, device));
}

}  // namespace epx
