// Binding of the fp8 (e4m3) forward: argument checks, FwdParams from tensors, the V pre-pass (fp8_vt.cu: V^T,
// keys contiguous and permuted within each 32, csrc/sm90/fp8_sm90.hpp says why), dispatch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <initializer_list>
#include <string>

#include "binding_common.h"
#include "dispatch.h"
#include "params.h"

namespace flash4 {
void launch_fp8_vt(const void* v, void* vt, int batch, int seqlen_k, int nheads_kv, int head_dim,
                   int64_t v_batch_stride, int64_t v_row_stride, int64_t v_head_stride, cudaStream_t stream);
}

namespace flash4::binding {
namespace {

void check_descale(const at::Tensor& t, const at::Tensor& q, int64_t batch, int64_t nheads_kv, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.dim() == 2 && t.size(0) == batch && t.size(1) == nheads_kv,
              std::string("flash_attn4: ") + name + " must be a contiguous float32 (" + str(batch) + ", " +
                  str(nheads_kv) + ") tensor on q's device, got " + str(t.sizes()));
}

// Writes softmax(q k^T * scale * q_descale * k_descale + mask) (v * v_descale) into out (bf16) and the LSE.
// q (b, sq, hq, d), k and v (b, sk, hk, d) e4m3; window as in flash_api.cpp's fwd (-1 = unbounded; causal and a
// window are never both given).
void fwd_fp8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
             const at::Tensor& q_descale, const at::Tensor& k_descale, const at::Tensor& v_descale,
             double softmax_scale, bool causal, int64_t window_left, int64_t window_right, int64_t kernel_arch) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &out, &lse}) {
    TORCH_CHECK(t->is_cuda() && t->device() == q.device(), "flash_attn4: all tensors must be on q's CUDA device");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn && k.scalar_type() == at::kFloat8_e4m3fn &&
                  v.scalar_type() == at::kFloat8_e4m3fn,
              "flash_attn4: the fp8 kernels take float8_e4m3fn q, k and v");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, "flash_attn4: fp8 attention writes a bfloat16 out");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "flash_attn4: q, k and v must be 4-D");
  const int64_t batch = q.size(0), seqlen_q = q.size(1), nheads_q = q.size(2), d = q.size(3);
  const int64_t seqlen_k = k.size(1), nheads_kv = k.size(2);
  const int64_t seqlen_k_pad = (seqlen_k + 31) / 32 * 32;
  TORCH_CHECK(k.size(0) == batch && k.size(3) == d, "flash_attn4: k must match q's batch and head_dim");
  TORCH_CHECK(nheads_kv > 0 && nheads_q % nheads_kv == 0, "flash_attn4: nheads_q must be a multiple of nheads_kv");
  TORCH_CHECK(v.sizes() == k.sizes(), "flash_attn4: v must have k's shape " + str(k.sizes()));
  TORCH_CHECK(batch * nheads_kv <= 65535, "flash_attn4: fp8 attention takes batch * nheads_kv <= 65535");
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn4: out must have q's shape");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == batch &&
                  lse.size(1) == nheads_q && lse.size(2) == seqlen_q,
              "flash_attn4: lse must be a contiguous float32 (batch, nheads_q, seqlen_q) tensor");
  TORCH_CHECK(batch >= 1 && seqlen_q >= 1 && seqlen_k >= 1, "flash_attn4: empty inputs are handled in Python");
  TORCH_CHECK(batch <= 65535 && nheads_q <= 65535, "flash_attn4: batch and nheads_q must be <= 65535");
  TORCH_CHECK(seqlen_q < (int64_t(1) << 30) && seqlen_k < (int64_t(1) << 30),
              "flash_attn4: sequence lengths must be < 2^30");
  check_descale(q_descale, q, batch, nheads_kv, "q_descale");
  check_descale(k_descale, q, batch, nheads_kv, "k_descale");
  check_descale(v_descale, q, batch, nheads_kv, "v_descale");
  check_tma_layout(q, "q");
  check_tma_layout(k, "k");
  check_tma_layout(v, "v");
  check_tma_layout(out, "out");
  TORCH_CHECK(!(causal && (window_left >= 0 || window_right >= 0)),
              "flash_attn4: pass causal or a window, not both (causal is window (-1, 0))");
  check_kernel_arch(q, kernel_arch);
  TORCH_CHECK(kernel_arch == 90, "flash_attn4: the fp8 kernels are sm90 kernels");
  const bool local = window_left >= 0 || window_right >= 0;
  const flash4::FwdKernelEntry* entry =
      flash4::find_fwd_kernel(90, flash4::DType::kE4M3, int(d), causal, local, /*sparse=*/false);
  TORCH_CHECK(entry != nullptr, "flash_attn4: no compiled fp8 forward kernel for head_dim " + str(d) +
                                    " (fp8 head dims: csrc/generate_kernels.py FP8_HDIMS)");

  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  at::Tensor vt = at::empty({batch, nheads_kv, d, seqlen_k_pad}, v.options());
  flash4::launch_fp8_vt(v.data_ptr(), vt.data_ptr(), int(batch), int(seqlen_k), int(nheads_kv), int(d), v.stride(0),
                        v.stride(1), v.stride(2), stream);

  flash4::FwdParams p;
  const int unbounded = int(seqlen_q + seqlen_k + 1);
  if (local) {
    p.window_left = window_side(window_left, unbounded);
    p.window_right = window_side(window_right, unbounded);
  }
  p.batch = int(batch), p.seqlen_q = int(seqlen_q), p.seqlen_k = int(seqlen_k);
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = vt.data_ptr(), p.o = out.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  // V^T: the "row" stride steps head_dim.
  p.v_batch_stride = vt.stride(0), p.v_head_stride = vt.stride(1), p.v_row_stride = vt.stride(2);
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.lse_batch_stride = nheads_q * seqlen_q, p.lse_head_stride = seqlen_q;
  p.nheads_q = int(nheads_q), p.nheads_kv = int(nheads_kv), p.head_dim = int(d);
  p.softmax_scale = float(softmax_scale);
  p.softmax_scale_log2 = float(softmax_scale * M_LOG2E);
  p.q_descale = q_descale.data_ptr<float>();
  p.k_descale = k_descale.data_ptr<float>();
  p.v_descale = v_descale.data_ptr<float>();
  p.dtype = flash4::DType::kE4M3;
  p.num_sms = num_sms(q);

  entry->launch(p, stream);
}

}  // namespace

void register_fp8(pybind11::module_& m) {
  m.def("fwd_fp8", &fwd_fp8, "fp8 (e4m3) attention forward into preallocated out (bf16) / lse", py::arg("q"),
        py::arg("k"), py::arg("vt"), py::arg("out"), py::arg("lse"), py::arg("q_descale"), py::arg("k_descale"),
        py::arg("v_descale"), py::arg("softmax_scale"), py::arg("causal"), py::arg("window_left") = -1,
        py::arg("window_right") = -1, py::arg("kernel_arch") = 90);
}

}  // namespace flash4::binding
