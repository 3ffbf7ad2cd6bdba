#include <torch/extension.h>

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slots, const torch::Tensor& lengths, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_linear", &panel_linear, "y = x @ w.T for a weight packed by avx512.pack");
  m.def("decode_attention", &decode_attention, "one query token per request against its cached context");
}
