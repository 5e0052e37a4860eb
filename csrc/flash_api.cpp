// The only file that includes torch: argument checks, Fwd/BwdParams from tensors, dispatch, Python binding.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "dispatch.h"
#include "params.h"

namespace {

using flash4::DType;

// Error messages are assembled with std::to_string and std::string only. Streaming integers into
// c10::str (std::ostringstream) crashed on the H200 machine: the extension, built by that machine's
// newer g++, carried its own ostream<<long whose locale facets did not match the process's libstdc++.
std::string str(at::IntArrayRef xs) {
  std::string s = "(";
  for (size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + std::to_string(xs[i]);
  return s + ")";
}
std::string str(int64_t x) { return std::to_string(x); }

// TMA descriptors need 16-byte aligned base addresses and strides (8 elements of a 16-bit type) and a
// contiguous innermost dimension. The Python side copies inputs that break this; these checks make a
// direct call fail loudly instead of faulting.
void check_tma_layout(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, std::string("flash_attn4: ") + name +
                                     " must have a contiguous last dimension (stride 1), got strides " +
                                     str(t.strides()));
  for (int d = 0; d < t.dim() - 1; ++d) {
    TORCH_CHECK(t.stride(d) % 8 == 0, std::string("flash_attn4: every stride of ") + name +
                                          " except the last must be a multiple of 8 elements (16 bytes) "
                                          "for TMA; got " + str(t.strides()) + ". Call .contiguous() first.");
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              std::string("flash_attn4: ") + name +
                  " must start at a 16-byte aligned address (got a view with an odd offset); call .contiguous().");
}

int device_arch(const at::Tensor& t) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.get_device());
  return prop->major * 10 + prop->minor;
}

// Forward kernel family for a device (flash_attn4/_build_info.py kernel_arch decides the same): the sm_90a
// kernels on compute capability 9.0 (arch-specific target, not forward compatible), the sm80 path on 8.x and
// on 9.x with FLASH_ATTN4_FORCE_SM80=1; 0 = none.
int fwd_kernel_arch(int arch) {
  const char* force = std::getenv("FLASH_ATTN4_FORCE_SM80");
  const bool force80 = force != nullptr && std::string(force) == "1";
  if (arch == 90 && !force80 && flash4::find_any_fwd_kernel(90)) return 90;
  return arch >= 80 ? 80 : 0;
}

// Writes softmax(q k^T * scale) v into `out` (b, sq, hq, d) and the natural-log LSE into `lse`
// (b, hq, sq, float32).
void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         double softmax_scale, bool causal) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && out.is_cuda() && lse.is_cuda(),
              "flash_attn4: all tensors must be on a CUDA device");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device() && out.device() == q.device() &&
                  lse.device() == q.device(),
              "flash_attn4: q, k, v, out and lse must be on the same device");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              std::string("flash_attn4: q must be bfloat16 or float16, got ") + c10::toString(dtype));
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && out.scalar_type() == dtype,
              "flash_attn4: q, k, v and out must share one dtype");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "flash_attn4: lse must be float32");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "flash_attn4: q, k, v must be 4-D (batch, seqlen, heads, head_dim)");

  const int64_t batch = q.size(0), seqlen_q = q.size(1), nheads_q = q.size(2), head_dim = q.size(3);
  const int64_t seqlen_k = k.size(1), nheads_kv = k.size(2);
  TORCH_CHECK(k.size(0) == batch && k.size(3) == head_dim,
              "flash_attn4: k must be (batch, seqlen_k, nheads_kv, " + str(head_dim) + "), got " + str(k.sizes()));
  TORCH_CHECK(v.sizes() == k.sizes(),
              "flash_attn4: v must have k's shape " + str(k.sizes()) + ", got " + str(v.sizes()));
  TORCH_CHECK(nheads_kv > 0 && nheads_q % nheads_kv == 0, "flash_attn4: nheads_q (" + str(nheads_q) +
                                                              ") must be a multiple of nheads_kv (" +
                                                              str(nheads_kv) + ")");
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn4: out must have q's shape " + str(q.sizes()));
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == nheads_q && lse.size(2) == seqlen_q &&
                  lse.is_contiguous(),
              "flash_attn4: lse must be a contiguous float32 tensor of shape (batch, nheads_q, seqlen_q)");
  TORCH_CHECK(seqlen_q >= 1 && seqlen_k >= 1 && batch >= 1, "flash_attn4: empty inputs are handled in Python");
  // Grid limits (y = heads, z = batch) and 32-bit TMA coordinates.
  TORCH_CHECK(batch <= 65535 && nheads_q <= 65535, "flash_attn4: batch and nheads_q must be <= 65535");
  TORCH_CHECK(seqlen_q < (int64_t(1) << 31) && seqlen_k < (int64_t(1) << 31), "flash_attn4: seqlen must be < 2^31");
  check_tma_layout(q, "q");
  check_tma_layout(k, "k");
  check_tma_layout(v, "v");
  check_tma_layout(out, "out");

  const DType kdtype = dtype == at::kBFloat16 ? DType::kBF16 : DType::kFP16;
  const int arch = device_arch(q);
  const int kernel_arch = fwd_kernel_arch(arch);
  const flash4::FwdKernelEntry* entry = flash4::find_fwd_kernel(kernel_arch, kdtype, int(head_dim), causal);
  TORCH_CHECK(entry != nullptr,
              "flash_attn4: no compiled forward kernel for sm_" + str(arch) + ", " +
                  (kdtype == DType::kBF16 ? "bf16" : "fp16") + ", head_dim " + str(head_dim) +
                  ", causal=" + (causal ? "True" : "False") +
                  ". Rebuild with that head dim/dtype in FLASH_ATTN4_HDIMS / FLASH_ATTN4_DTYPES, or use a "
                  "Hopper GPU.");

  flash4::FwdParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
  p.batch = int(batch);
  p.seqlen_q = int(seqlen_q);
  p.seqlen_k = int(seqlen_k);
  p.nheads_q = int(nheads_q);
  p.nheads_kv = int(nheads_kv);
  p.head_dim = int(head_dim);
  p.softmax_scale = float(softmax_scale);
  p.softmax_scale_log2 = float(softmax_scale * M_LOG2E);
  p.causal = causal;
  p.dtype = kdtype;

  const c10::cuda::CUDAGuard guard(q.device());
  entry->launch(p, at::cuda::getCurrentCUDAStream().stream());
}

// Gradients of fwd: writes dq (like q), dk and dv (like k and v; summed over each GQA group's query heads).
// Uses fp32 scratch allocated here (dq_accum, D, lse in log2 units), rows padded to a multiple of 128.
// deterministic: key blocks add into dq in a fixed order (bitwise-reproducible dq; dk and dv always are).
// dlse: gradient of lse (return_lse), or None for zero.
void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
         double softmax_scale, bool causal, bool deterministic, const std::optional<at::Tensor>& dlse) {
  using TensorList = std::initializer_list<const at::Tensor*>;
  for (const at::Tensor* t : TensorList{&dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv}) {
    TORCH_CHECK(t->is_cuda() && t->device() == q.device(), "flash_attn4: all tensors must be on q's CUDA device");
  }
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              std::string("flash_attn4: q must be bfloat16 or float16, got ") + c10::toString(dtype));
  for (const at::Tensor* t : TensorList{&dout, &k, &v, &out, &dq, &dk, &dv}) {
    TORCH_CHECK(t->scalar_type() == dtype, "flash_attn4: q, k, v, out, dout, dq, dk and dv must share one dtype");
  }
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "flash_attn4: q, k, v must be 4-D (batch, seqlen, heads, head_dim)");
  const int64_t batch = q.size(0), seqlen_q = q.size(1), nheads_q = q.size(2), head_dim = q.size(3);
  const int64_t seqlen_k = k.size(1), nheads_kv = k.size(2);
  TORCH_CHECK(k.size(0) == batch && k.size(3) == head_dim && v.sizes() == k.sizes(),
              "flash_attn4: k and v must be (batch, seqlen_k, nheads_kv, " + str(head_dim) + "), got " +
                  str(k.sizes()) + " and " + str(v.sizes()));
  TORCH_CHECK(nheads_kv > 0 && nheads_q % nheads_kv == 0, "flash_attn4: nheads_q (" + str(nheads_q) +
                                                              ") must be a multiple of nheads_kv (" +
                                                              str(nheads_kv) + ")");
  TORCH_CHECK(out.sizes() == q.sizes() && dout.sizes() == q.sizes() && dq.sizes() == q.sizes(),
              "flash_attn4: out, dout and dq must have q's shape " + str(q.sizes()));
  TORCH_CHECK(dk.sizes() == k.sizes() && dv.sizes() == k.sizes(),
              "flash_attn4: dk and dv must have k's shape " + str(k.sizes()));
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == batch &&
                  lse.size(1) == nheads_q && lse.size(2) == seqlen_q,
              "flash_attn4: lse must be the forward's contiguous float32 (batch, nheads_q, seqlen_q) tensor");
  TORCH_CHECK(seqlen_q >= 1 && seqlen_k >= 1 && batch >= 1, "flash_attn4: empty inputs are handled in Python");
  if (dlse.has_value()) {
    TORCH_CHECK(dlse->is_cuda() && dlse->device() == q.device() && dlse->scalar_type() == at::kFloat &&
                    dlse->is_contiguous() && dlse->sizes() == lse.sizes(),
                "flash_attn4: dlse must be a contiguous float32 tensor shaped like lse, on q's device");
  }
  TORCH_CHECK(batch <= 65535 && nheads_q <= 65535, "flash_attn4: batch and nheads_q must be <= 65535");
  check_tma_layout(q, "q");
  check_tma_layout(k, "k");
  check_tma_layout(v, "v");
  check_tma_layout(dout, "dout");
  // out, dq, dk, dv are read/written with plain vector accesses: a contiguous last dim, 16-byte rows.
  check_tma_layout(out, "out");
  check_tma_layout(dq, "dq");
  check_tma_layout(dk, "dk");
  check_tma_layout(dv, "dv");

  const DType kdtype = dtype == at::kBFloat16 ? DType::kBF16 : DType::kFP16;
  const int arch = device_arch(q);
  const flash4::BwdKernelEntry* entry = flash4::find_bwd_kernel(arch == 90 ? 90 : 0, kdtype, int(head_dim), causal);
  TORCH_CHECK(entry != nullptr, "flash_attn4: no compiled backward kernel for sm_" + str(arch) + ", " +
                                    (kdtype == DType::kBF16 ? "bf16" : "fp16") + ", head_dim " + str(head_dim) +
                                    ", causal=" + (causal ? "True" : "False"));

  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t seqlen_q_rounded = (seqlen_q + 127) / 128 * 128;
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq_accum = at::empty({batch, nheads_q, seqlen_q_rounded, head_dim}, f32);
  at::Tensor dpsum = at::empty({batch, nheads_q, seqlen_q_rounded}, f32);
  at::Tensor lse_log2 = at::empty({batch, nheads_q, seqlen_q_rounded}, f32);
  // One turn counter per 64-row query block (the kernel's kBlockM), zeroed: see BwdParams::dq_semaphore.
  at::Tensor dq_semaphore =
      deterministic ? at::zeros({batch, nheads_q, seqlen_q_rounded / 64}, q.options().dtype(at::kInt)) : at::Tensor();

  flash4::BwdParams p;
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.out = out.data_ptr(), p.dout = dout.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.out_batch_stride = out.stride(0), p.out_row_stride = out.stride(1), p.out_head_stride = out.stride(2);
  p.dout_batch_stride = dout.stride(0), p.dout_row_stride = dout.stride(1), p.dout_head_stride = dout.stride(2);
  p.lse = lse.data_ptr<float>();
  p.dlse = dlse.has_value() ? dlse->data_ptr<float>() : nullptr;
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  p.dq_batch_stride = dq.stride(0), p.dq_row_stride = dq.stride(1), p.dq_head_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0), p.dk_row_stride = dk.stride(1), p.dk_head_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_row_stride = dv.stride(1), p.dv_head_stride = dv.stride(2);
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dpsum = dpsum.data_ptr<float>();
  p.lse_log2 = lse_log2.data_ptr<float>();
  p.dq_semaphore = deterministic ? dq_semaphore.data_ptr<int>() : nullptr;
  p.seqlen_q_rounded = int(seqlen_q_rounded);
  p.batch = int(batch), p.seqlen_q = int(seqlen_q), p.seqlen_k = int(seqlen_k);
  p.nheads_q = int(nheads_q), p.nheads_kv = int(nheads_kv), p.head_dim = int(head_dim);
  p.softmax_scale = float(softmax_scale);
  p.softmax_scale_log2 = float(softmax_scale * M_LOG2E);
  p.causal = causal;
  p.dtype = kdtype;
  entry->launch(p, at::cuda::getCurrentCUDAStream().stream());
}

std::vector<std::string> compiled_kernels() {
  std::vector<std::string> names;
  for (int i = 0; i < flash4::kNumFwdKernels; ++i) names.emplace_back(flash4::kFwdKernels[i].name);
  for (int i = 0; i < flash4::kNumBwdKernels; ++i) names.emplace_back(flash4::kBwdKernels[i].name);
  return names;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_attn4 CUDA kernels (use flash_attn4.attn, not this module directly)";
  m.def("fwd", &fwd, "Attention forward into preallocated out/lse", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"));
  m.def("bwd", &bwd, "Attention backward into preallocated dq/dk/dv", py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("deterministic") = false, py::arg("dlse") = py::none());
  m.def("compiled_kernels", &compiled_kernels, "Names of the kernel instantiations in this build");
}
