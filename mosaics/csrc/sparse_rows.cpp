// The decoding row of sparsemax attention on CPU, fp32: one query per (batch, head) that sees
// every memory entry. z_j = beta_h (q . k_j); the entries within 1 of the row max are the only
// ones that can have weight; sorted descending, tau = max_k (sum_{i<=k} z_(i) - 1) / k, and
// y = sum_j [z_j - tau]_+ v_j.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

inline float dot(const float* a, const float* b, int64_t n) {
  return at::vec::map2_reduce_all<float>(
      [](Vec x, Vec y) { return x * y; }, [](Vec x, Vec y) { return x + y; }, a, b, n);
}

}  // namespace

// q: (BH, D); keys, values: (BH, S, D) with unit stride along D and stride D along S;
// beta: (BH,). Returns (BH, D).
torch::Tensor sparsemax_rows(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                             torch::Tensor beta) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 &&
              values.dtype() == torch::kFloat32 && beta.dtype() == torch::kFloat32,
              "sparsemax_rows: fp32 only");
  TORCH_CHECK(q.dim() == 2 && keys.dim() == 3 && values.dim() == 3 && beta.dim() == 1,
              "sparsemax_rows: q (BH, D), keys and values (BH, S, D), beta (BH,)");
  const int64_t BH = keys.size(0), S = keys.size(1), D = keys.size(2);
  TORCH_CHECK(q.size(0) == BH && q.size(1) == D && values.size(0) == BH &&
              values.size(1) == S && values.size(2) == D && beta.size(0) == BH,
              "sparsemax_rows: sizes must agree: q (BH, D), keys and values (BH, S, D), "
              "beta (BH,)");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == D && values.stride(2) == 1 &&
              values.stride(1) == D && q.stride(1) == 1 && beta.stride(0) == 1,
              "sparsemax_rows: rows of D contiguous entries");
  auto out = torch::zeros({BH, D}, q.options());
  if (S == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = keys.stride(0), vs = values.stride(0);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> z(S);
    std::vector<std::pair<float, int64_t>> cand;
    for (int64_t r = begin; r < end; ++r) {
      const float* qr = qp + r * qs;
      const float* kr = kp + r * ks;
      const float b = bp[r];
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < S; ++j) {
        z[j] = b * dot(qr, kr + j * D, D);
        top = std::max(top, z[j]);
      }
      cand.clear();
      for (int64_t j = 0; j < S; ++j) {
        if (z[j] > top - 1.0f) cand.emplace_back(z[j] - top, j);
      }
      std::sort(cand.begin(), cand.end(),
                [](const auto& a, const auto& c) { return a.first > c.first; });
      float sum = 0.0f, tau = -std::numeric_limits<float>::infinity();
      for (size_t k = 0; k < cand.size(); ++k) {
        sum += cand[k].first;
        tau = std::max(tau, (sum - 1.0f) / static_cast<float>(k + 1));
      }
      float* orow = op + r * D;
      const float* vr = vp + r * vs;
      for (const auto& c : cand) {
        const float w = c.first - tau;
        if (w <= 0.0f) continue;
        const float* v = vr + c.second * D;
        at::vec::map2([w](Vec o, Vec x) { return o + x * Vec(w); }, orow, orow, v, D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("sparsemax_rows", &sparsemax_rows); }
