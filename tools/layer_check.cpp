#include "tools/layer_check.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "epx/comm.h"
#include "epx/error.h"
#include "epx/moe.h"
#include "moe/elementwise.h"
#include "tools/launch.h"
#include "tools/layer_run.h"

namespace epx::tools {

Compare compare(const TensorRef& got_any, const TensorRef& want_any) {
  const Tensor got = Tensor::wrap(got_any, nullptr).to(Device::cpu());
  const Tensor want = Tensor::wrap(want_any, nullptr).to(Device::cpu());
  double num = 0, den = 0, mx = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = got.item(i) - want.item(i);
    num += d * d;
    den += want.item(i) * want.item(i);
    mx = std::max(mx, std::fabs(d));
  }
  return {den > 0 ? std::sqrt(num / den) : std::sqrt(num), mx};
}

// One forward + backward of a reduced DeepSeek-style layer on the GPUs against R simulated ranks of
// the CPU reference. Each process computes the reference of every rank and compares its own.
LayerCheck check_layer_against_reference(const ShapePreset& preset, uint64_t seed, MlpPrecision precision) {
  MoEConfig c = moe_config(preset, DType::kBF16);
  const bool fp8 = precision != MlpPrecision::kHigh;
  const int64_t ffn = fp8 ? 128 : 64;
  c.precision = precision;
  c.hidden = 256;
  c.ffn_hidden = ffn;
  c.shared_ffn_hidden = c.shared_ffn_hidden > 0 ? ffn : 0;
  c.router.num_experts = 32;
  c.router.topk = std::min(c.router.topk, 8);
  c.router.num_groups = std::min(c.router.num_groups, 8);
  c.router.group_topk = std::min(c.router.group_topk, c.router.num_groups);
  c.expert_grads_in_dtype = true;  // as the full-size run
  const int64_t T = 64;
  const GroupConfig gc = layer_group_config(c, T);

  Group gpu = make_gpu_group(gc);
  const int R = gpu.size(), me = gpu.rank();
  require(c.router.num_experts % R == 0, "epx demo", "the reference check needs the ranks (", R,
          ") to divide its 32 experts");
  auto inputs = [&](int r, Device dev, Tensor& x, Tensor& d_out) {
    x = Tensor::empty({T, c.hidden}, c.dtype, dev);
    d_out = Tensor::empty({T, c.hidden}, c.dtype, dev);
    detail::fill_normal(x, seed, 10 + r, 1.0);
    detail::fill_normal(d_out, seed, 50 + r, 0.1);
  };
  auto sharpen = [&](MoELayer& L) {  // a sharper gate, so rounding does not move tokens between experts
    detail::fill_normal(L.params().gate, seed, 77, 1.0);
  };

  // The reference: R simulated ranks.
  std::vector<Group> host = Group::create_simulated(R, gc);
  std::vector<std::unique_ptr<MoELayer>> ref(R);
  std::vector<Tensor> rx(R), rd(R), rout(R), rdx(R);
  std::vector<MoEContext> rctx(R);
  for (int r = 0; r < R; ++r) {
    ref[r] = std::make_unique<MoELayer>(host[r], c);
    ref[r]->init_params(seed, 0.1);
    sharpen(*ref[r]);
    inputs(r, Device::cpu(), rx[r], rd[r]);
    rout[r] = Tensor::zeros({T, c.hidden}, c.dtype);
    rdx[r] = Tensor::zeros({T, c.hidden}, c.dtype);
  }
  run_ranks(host, [&](Group& g) {
    const int r = g.rank();
    rctx[r] = ref[r]->forward(rx[r], rout[r]);
    ref[r]->backward(rctx[r], rd[r], rdx[r]);
  });

  // The GPU layer, this rank.
  MoELayer L(gpu, c);
  L.init_params(seed, 0.1);
  sharpen(L);
  Tensor x, d_out;
  inputs(me, gpu.device(), x, d_out);
  Tensor out = Tensor::zeros({T, c.hidden}, c.dtype, gpu.device()), d_x = Tensor::zeros({T, c.hidden}, c.dtype, gpu.device());
  MoEContext ctx = L.forward(x, out);
  L.backward(ctx, d_out, d_x);
  gpu.check();

  LayerCheck res;
  res.out = compare(out, rout[me]);
  res.d_x = compare(d_x, rdx[me]);
  res.w_in = compare(L.grads().w_in, ref[me]->grads().w_in);
  res.gate = compare(L.grads().gate, ref[me]->grads().gate);
  const Tensor gi = ctx.topk_idx().to(Device::cpu()), hi = rctx[me].topk_idx().to(Device::cpu());
  int same = 0;
  const int K = c.router.topk;
  for (int64_t t = 0; t < T; ++t)
    same += std::equal(gi.ptr<int32_t>() + t * K, gi.ptr<int32_t>() + (t + 1) * K, hi.ptr<int32_t>() + t * K);
  res.routing_agreement = static_cast<double>(same) / static_cast<double>(T);
  // bf16 tolerances (the GPU rounds where the reference keeps fp32; see expert_mlp_cuda.cu); FP8's
  // requantization of slightly different h rows adds to them.
  const double k = fp8 ? 1.5 : 1.0;
  res.ok = res.routing_agreement >= 0.9 && res.out.rel < 5e-2 * k && res.d_x.rel < 8e-2 * k &&
           res.w_in.rel < 8e-2 * k && res.gate.rel < 8e-2 * k;
  return res;
}

}  // namespace epx::tools
