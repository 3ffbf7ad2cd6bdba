#include "kernels.h"
#include "vec_math.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = CHARIOTEER_ISA;
  m.attr("panel_width") = panel_width();
  m.attr("panel_row_block") = panel_row_block();
  m.attr("decode_attention_chunk") = decode_attention_chunk();
  m.def("panel_linear", &panel_linear, "y = x @ w.T for a weight packed by cpu_kernels.pack", py::arg("x"),
        py::arg("panels"), py::arg("n"), py::arg("scale") = py::none(), py::arg("out") = py::none());
  m.def("decode_attention", &decode_attention, "one query token per request against its cached context");
  m.def("store_kv", &store_kv, "write the step's K and V rows into their cache slots");
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta in place; returns RMSNorm(x) * weight", py::arg("x"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("bf16_out") = false, py::arg("out") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight, x fp32 and untouched: add_rms_norm_'s bits for a -0.0 delta",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("out") = py::none());
  m.def("rope", &rope, "x * cos + roll(x) * signed_sin, bitwise the formula", py::arg("x"), py::arg("cos"),
        py::arg("signed_sin"), py::arg("out") = py::none());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up projection", py::arg("gate_up"),
        py::arg("out") = py::none());
  py::class_<DecodeLayers>(m, "DecodeLayers", py::module_local())  // each build registers its own
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, int64_t, bool, bool, int64_t, int64_t, int64_t, int64_t, double,
                    double>())
      .def("run", &DecodeLayers::run, "x through every layer for a decode-only batch; x is updated in place")
      .def("run_tokens", &DecodeLayers::run_tokens,
           "a decode-only batch's tokens embedded and through every layer: the final norm's output");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum");
  m.def("amx_ready", &amx_ready, "whether Linux granted this process AMX's tile state");
  m.def("amx_pack", &amx_pack, "a bf16 weight [N, K] in the order AMX's B tiles read it");
  m.def("amx_linear", &amx_linear, "x bf16 @ w.T on AMX tiles, for a weight packed by amx_pack", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bf16_output") = false);
  m.def("avx512_bf16_linear", &avx512_bf16_linear, "x bf16 @ w.T with AVX512-BF16 for a weight packed by amx_pack",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bf16_output") = false, py::arg("out") = py::none());
  m.def("avx512_bf16_linear_int8", &avx512_bf16_linear_int8,
        "x fp32 @ (q * scale).T with AVX512-BF16 for int8 panels: q widened to bf16, x rounded to it");
  m.def("vnni_linear_int8", &vnni_linear_int8,
        "x fp32 @ (q * scale).T with AVX512-VNNI for int8 panels: x quantized to int16 per block of 128 values",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("scale"), py::arg("out") = py::none());
  m.def("gguf_linear", &gguf_linear,
        "x fp32 @ W.T for W in GGUF blocks (gguf_blocks): x quantized to int16 (or int8) per block of 32",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("vnni") = false, py::arg("out") = py::none());
  m.def("amx_linear_int8", &amx_linear_int8, "x fp32 @ (q * scale).T on AMX int8 tiles for int8 panels: x quantized per row to int16");
  m.def("prefill_attention", &prefill_attention, "a prompt chunk's causal attention in vectors", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("start"), py::arg("scale"), py::arg("out"), py::arg("bf16_products") = false);
  m.def("amx_prefill_attention", &amx_prefill_attention, "a prompt chunk's causal attention on AMX tiles");
}
