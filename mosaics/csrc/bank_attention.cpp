// Slot-bank attention y = softmax(q k^T) v on CPU, fp32, keeping the probabilities.
//
// q: (H, N, D) unit queries; k, v: (H, P, D) banks. The forward writes p = softmax(q k^T) per
// head into an (N, P) buffer that the backward reads instead of recomputing q k^T and its exp:
//
//   dv^T += do^T p,   dp = do v^T,   ds = p * (dp - rowsum(do * y)),   dq = ds k,   dk^T += q^T ds
//
// Every product is a row-major (M x K) (K x N) call of ATen's oneDNN batch-reduce GEMM
// (at::native::cpublas::brgemm), on blocks of `rows` queries per head. The (D x P) transposes
// of k and v, and the (D x rows) ones of q and do, keep every product free of a transposed
// operand. Forward tasks: (head, block of rows); backward tasks: (head, group of blocks), so
// that a few heads still fill many threads.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// C (M x N, ldc) = A (M x K, lda) B (K x N, ldb), or C += A B with accumulate
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, false);
}

// x <- softmax(x) over n entries
inline void softmax_row(float* x, int64_t n) {
  const float mx = at::vec::reduce_all<float>(
      [](Vec a, Vec b) { return at::vec::maximum(a, b); }, x, n);
  const Vec vmx(mx);
  at::vec::map([vmx](Vec a) { return (a - vmx).exp_u20(); }, x, x, n);
  const float inv = 1.0f / at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, x, n);
  const Vec vinv(inv);
  at::vec::map([vinv](Vec a) { return a * vinv; }, x, x, n);
}

// dst (cols x rows) = src (rows x cols)^T, src row stride ld
inline void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * ld + j];
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.dim() == 3 &&
                  t.is_contiguous(),
              name, " must be a contiguous (H, n, D) float32 CPU tensor");
}

}  // namespace

// (y (H, N, D), p: H tensors (N, P))
std::vector<torch::Tensor> bank_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                        int64_t rows) {
  check(q, "q");
  check(k, "k");
  check(v, "v");
  const int64_t H = q.size(0), N = q.size(1), D = q.size(2), P = k.size(1);
  TORCH_CHECK(k.size(0) == H && v.sizes() == k.sizes() && k.size(2) == D && rows > 0,
              "bank shapes do not match the queries'");
  auto kt = k.transpose(1, 2).contiguous();  // (H, D, P)
  auto y = torch::empty_like(q);
  // one buffer per head: each stays under glibc's 32 MB mmap threshold at the usual sizes,
  // so it is reused from the heap instead of being page-faulted in on every call
  std::vector<torch::Tensor> probs;
  for (int64_t h = 0; h < H; ++h) probs.push_back(torch::empty({N, P}, q.options()));
  const float *qp = q.data_ptr<float>(), *ktp = kt.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + rows - 1) / rows;
  at::parallel_for(0, H * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / blocks, r0 = (t % blocks) * rows, m = std::min(rows, N - r0);
      float* s = probs[h].data_ptr<float>() + r0 * P;
      gemm(m, P, D, qp + (h * N + r0) * D, D, ktp + h * D * P, P, s, P, false);
      for (int64_t i = 0; i < m; ++i) softmax_row(s + i * P, P);
      gemm(m, D, P, s, P, vp + h * P * D, D, yp + (h * N + r0) * D, D, false);
    }
    at::native::cpublas::brgemm_release();
  });
  probs.insert(probs.begin(), y);
  return probs;
}

// (dq, dk, dv) from the output gradient g and the forward's y and p
std::vector<torch::Tensor> bank_backward(torch::Tensor g, torch::Tensor q, torch::Tensor k,
                                         torch::Tensor v, torch::Tensor y,
                                         std::vector<torch::Tensor> probs, int64_t rows) {
  for (auto* t : {&g, &q, &k, &v, &y}) check(*t, "bank tensors");
  const int64_t H = q.size(0), N = q.size(1), D = q.size(2), P = k.size(1);
  TORCH_CHECK(g.sizes() == q.sizes() && y.sizes() == q.sizes() && k.sizes() == v.sizes() &&
                  static_cast<int64_t>(probs.size()) == H && rows > 0,
              "bank backward: g and y must be shaped as q, one probability buffer per head");
  auto vt = v.transpose(1, 2).contiguous();  // (H, D, P)
  auto dq = torch::empty_like(q);
  // each head's row blocks split into `groups` tasks, enough to give every thread one; each
  // task sums its dk^T and dv^T into its own (D, P) slice, added up after
  const int64_t blocks = (N + rows - 1) / rows;
  const int64_t groups =
      std::min(blocks, std::max<int64_t>(1, (at::get_num_threads() + H - 1) / H));
  const int64_t per_group = (blocks + groups - 1) / groups;
  auto dkt = torch::zeros({H, groups, D, P}, q.options());
  auto dvt = torch::zeros({H, groups, D, P}, q.options());
  const float *gp = g.data_ptr<float>(), *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(),
              *vtp = vt.data_ptr<float>(), *yp = y.data_ptr<float>();
  float *dqp = dq.data_ptr<float>(), *dktp = dkt.data_ptr<float>(), *dvtp = dvt.data_ptr<float>();
  at::parallel_for(0, H * groups, 1, [&](int64_t t0, int64_t t1) {
    const int64_t width = std::min(rows, N);
    std::vector<float> ds(width * P), gt(D * width), qt(D * width);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / groups, grp = t % groups;
      const float* ph = probs[h].data_ptr<float>();
      float *dk_t = dktp + t * D * P, *dv_t = dvtp + t * D * P;
      const int64_t b1 = std::min(blocks, (grp + 1) * per_group);
      for (int64_t b = grp * per_group; b < b1; ++b) {
        const int64_t r0 = b * rows, m = std::min(rows, N - r0);
        const float *gb = gp + (h * N + r0) * D, *qb = qp + (h * N + r0) * D;
        const float *yb = yp + (h * N + r0) * D, *pb = ph + r0 * P;
        transpose(gb, m, D, D, gt.data());
        gemm(D, P, m, gt.data(), m, pb, P, dv_t, P, true);               // dv^T += do^T p
        gemm(m, P, D, gb, D, vtp + h * D * P, P, ds.data(), P, false);  // dp = do v^T
        for (int64_t i = 0; i < m; ++i) {                               // ds = p (dp - <do, y>)
          const float delta = at::vec::map2_reduce_all<float>(
              [](Vec a, Vec b) { return a * b; }, [](Vec a, Vec b) { return a + b; },
              gb + i * D, yb + i * D, D);
          const Vec vdelta(delta);
          float* row = ds.data() + i * P;
          at::vec::map2([vdelta](Vec d, Vec p) { return (d - vdelta) * p; }, row, row,
                        pb + i * P, P);
        }
        gemm(m, D, P, ds.data(), P, kp + h * P * D, D, dqp + (h * N + r0) * D, D, false);
        transpose(qb, m, D, D, qt.data());
        gemm(D, P, m, qt.data(), m, ds.data(), P, dk_t, P, true);       // dk^T += q^T ds
      }
    }
    at::native::cpublas::brgemm_release();
  });
  auto dk = (groups > 1 ? dkt.sum(1) : dkt.select(1, 0)).transpose(1, 2).contiguous();
  auto dv = (groups > 1 ? dvt.sum(1) : dvt.select(1, 0)).transpose(1, 2).contiguous();
  return {dq, dk, dv};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &bank_forward, "softmax(q k^T) v and the probabilities");
  m.def("backward", &bank_backward, "gradients of softmax(q k^T) v from stored probabilities");
}
