// CPU reference of gemm and the grouped GEMM (forward, dgrad, wgrad).
//
//   gemm     c[m, n]  = round( (accumulate ? c_old : 0) + sum_k op(a)[m, k] op(b)[k, n] )
//   forward  y[r, n]  = round( sum_k x[r, k] w[j, k, n] )          r a real row of group j
//   dgrad    dx[r, k] = round( sum_n dy[r, n] w[j, k, n] )
//   wgrad    dw[j, k, n] = round( (accumulate ? dw_old : 0) + sum_r x[r, k] dy[r, n] )
// with each sum one Acc chain (fp32, fp64 for fp64 inputs) in ascending index order; the old value
// is added to the finished sum, not used as its seed, as a GEMM epilogue with beta = 1 does.
// Padding rows of y / dx get zeros, rows at or past offsets[G] are not touched; an empty group's
// dw[j] is zero, or left as it was when accumulating.
#include "ref/grouped_gemm.h"

#include "epx/error.h"

namespace epx::ref {

std::vector<GroupSpan> read_groups(const char* fn, const TensorRef& offsets, const TensorRef& rows,
                                   int64_t rows_total) {
  const int64_t G = rows.size(0);
  const int32_t* off = offsets.ptr<int32_t>();
  const int32_t* cnt = rows.ptr<int32_t>();
  require(off[0] == 0, fn, "offsets[0] is ", off[0], ", expected 0");
  std::vector<GroupSpan> spans(static_cast<size_t>(G));
  for (int64_t j = 0; j < G; ++j) {
    const int64_t begin = off[j], n = cnt[j], next = off[j + 1];
    require(n >= 0, fn, "rows[", j, "] is ", n, ", expected >= 0");
    require(next >= begin, fn, "offsets decrease at group ", j, ": offsets[", j + 1, "] = ", next, " < offsets[", j,
            "] = ", begin, " (expected padded prefix offsets)");
    // int64 sums: offsets near INT32_MAX must be reported, not wrapped around.
    require(begin + n <= next, fn, "group ", j, " overflows into the next one: offsets[", j, "] + rows[", j,
            "] = ", begin, " + ", n, " = ", begin + n, " > offsets[", j + 1, "] = ", next);
    spans[j] = GroupSpan{begin, n, next};
  }
  require(off[G] <= rows_total, fn, "offsets[", G, "] is ", off[G], ", more than the ", rows_total,
          " rows of the tensors");
  return spans;
}

void store_zeros(const TensorRef& t, int64_t offset, int64_t n) {
  if (n <= 0) return;
  std::vector<float> z(static_cast<size_t>(n), 0.0f);
  store_row(t.data(), t.dtype(), offset, n, z.data());
}

namespace {

bool wide(DType t) { return t == DType::kF64; }

template <class Acc>
void gemm_impl(const TensorRef& a, const TensorRef& b, const TensorRef& c, bool ta, bool tb, bool accumulate) {
  const int64_t M = c.size(0), N = c.size(1), K = ta ? a.size(0) : a.size(1);
  const std::vector<Acc> A = load_matrix<Acc>(a, 0, a.size(0), a.size(1), ta);  // [M, K]
  const std::vector<Acc> B = load_matrix<Acc>(b, 0, b.size(0), b.size(1), tb);  // [K, N]
  std::vector<Acc> acc(static_cast<size_t>(N)), old(static_cast<size_t>(N));
  for (int64_t m = 0; m < M; ++m) {
    row_times_matrix(A.data() + m * K, K, B.data(), N, acc.data());
    if (accumulate) {
      load_row(c.data(), c.dtype(), m * N, N, old.data());
      for (int64_t n = 0; n < N; ++n) acc[n] = old[n] + acc[n];
    }
    store_row(c.data(), c.dtype(), m * N, N, acc.data());
  }
}

// Shared by forward and dgrad: out[r] = in[r] . B_j for every real row, with B_j [K, N] built per
// group by `load_b` (w[j] itself for forward, w[j]^T for dgrad).
template <class Acc, class LoadB>
void grouped_rows_impl(const char* fn, const TensorRef& in, const TensorRef& offsets, const TensorRef& rows,
                       const TensorRef& out, LoadB load_b) {
  const int64_t K = in.size(1), N = out.size(1);
  const std::vector<GroupSpan> groups = read_groups(fn, offsets, rows, in.size(0));
  std::vector<Acc> x(static_cast<size_t>(K)), y(static_cast<size_t>(N));
  for (size_t j = 0; j < groups.size(); ++j) {
    const GroupSpan& g = groups[j];
    if (g.rows > 0) {
      const std::vector<Acc> B = load_b(static_cast<int64_t>(j));
      for (int64_t r = g.begin; r < g.begin + g.rows; ++r) {
        load_row(in.data(), in.dtype(), r * K, K, x.data());
        row_times_matrix(x.data(), K, B.data(), N, y.data());
        store_row(out.data(), out.dtype(), r * N, N, y.data());
      }
    }
    store_zeros(out, (g.begin + g.rows) * N, (g.end - g.begin - g.rows) * N);
  }
}

template <class Acc>
void wgrad_impl(const TensorRef& x, const TensorRef& dy, const TensorRef& offsets, const TensorRef& rows,
                const TensorRef& dw, bool accumulate) {
  const int64_t K = x.size(1), N = dy.size(1);
  const std::vector<GroupSpan> groups = read_groups("epx::grouped_gemm_wgrad", offsets, rows, x.size(0));
  std::vector<Acc> xr(static_cast<size_t>(K)), dyr(static_cast<size_t>(N)), acc(static_cast<size_t>(K * N)),
      old(static_cast<size_t>(K * N));
  for (size_t j = 0; j < groups.size(); ++j) {
    const GroupSpan& g = groups[j];
    if (accumulate && g.rows == 0) continue;  // exactly unchanged (old + 0 would turn -0 into +0)
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t r = g.begin; r < g.begin + g.rows; ++r) {
      load_row(x.data(), x.dtype(), r * K, K, xr.data());
      load_row(dy.data(), dy.dtype(), r * N, N, dyr.data());
      for (int64_t k = 0; k < K; ++k) {
        const Acc xk = xr[k];
        Acc* out = acc.data() + k * N;
        for (int64_t n = 0; n < N; ++n) out[n] += xk * dyr[n];
      }
    }
    const int64_t base = static_cast<int64_t>(j) * K * N;
    if (accumulate) {
      load_row(dw.data(), dw.dtype(), base, K * N, old.data());
      for (int64_t i = 0; i < K * N; ++i) acc[i] = old[i] + acc[i];
    }
    store_row(dw.data(), dw.dtype(), base, K * N, acc.data());
  }
}

}  // namespace

void gemm(const TensorRef& a, const TensorRef& b, const TensorRef& c, bool transpose_a, bool transpose_b,
          bool accumulate) {
  if (wide(a.dtype()))
    gemm_impl<double>(a, b, c, transpose_a, transpose_b, accumulate);
  else
    gemm_impl<float>(a, b, c, transpose_a, transpose_b, accumulate);
}

void grouped_gemm_forward(const TensorRef& x, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                          const TensorRef& y) {
  const int64_t K = w.size(1), N = w.size(2);
  auto run = [&](auto zero) {
    using Acc = decltype(zero);
    grouped_rows_impl<Acc>("epx::grouped_gemm_forward", x, offsets, rows, y,
                           [&](int64_t j) { return load_matrix<Acc>(w, j * K * N, K, N, false); });
  };
  if (wide(x.dtype())) run(0.0); else run(0.0f);
}

void grouped_gemm_dgrad(const TensorRef& dy, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dx) {
  const int64_t K = w.size(1), N = w.size(2);
  auto run = [&](auto zero) {
    using Acc = decltype(zero);
    grouped_rows_impl<Acc>("epx::grouped_gemm_dgrad", dy, offsets, rows, dx,
                           [&](int64_t j) { return load_matrix<Acc>(w, j * K * N, K, N, true); });  // [N, K]
  };
  if (wide(dy.dtype())) run(0.0); else run(0.0f);
}

void grouped_gemm_wgrad(const TensorRef& x, const TensorRef& dy, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dw, bool accumulate) {
  if (wide(x.dtype()))
    wgrad_impl<double>(x, dy, offsets, rows, dw, accumulate);
  else
    wgrad_impl<float>(x, dy, offsets, rows, dw, accumulate);
}

}  // namespace epx::ref
