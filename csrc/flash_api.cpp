// The only file that includes torch: argument checks, Fwd/BwdParams from tensors, dispatch, Python binding.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "binding_common.h"
#include "common/trace.hpp"
#include "dispatch.h"
#include "params.h"

namespace {

using flash4::DType;
using namespace flash4::binding;

// The options shared by forward and backward: masks, softcap and packed-batch geometry.
struct Options {
  bool causal = false, local = false;  // which mask kernel the dispatch table picks
  int window_left = 0, window_right = 0;
  float softcap = 0.f;
  bool packed = false;
  const int* cu_q = nullptr;
  const int* cu_k = nullptr;
  const int* used_q = nullptr;
  const int* used_k = nullptr;
  int batch = 0, seqlen_q = 0, seqlen_k = 0, total_q = 0, total_k = 0;
};

// Checks the int32 offset/length vectors of a packed batch (values are not read: that would synchronize).
const int* check_index(const OptTensor& t, int64_t numel, const at::Tensor& q, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->device() == q.device() && t->scalar_type() == at::kInt && t->dim() == 1 &&
                  t->numel() == numel && t->is_contiguous(),
              std::string("flash_attn4: ") + name + " must be a contiguous int32 CUDA tensor of " + str(numel) +
                  " elements on q's device");
  return t->data_ptr<int>();
}

// Mask kernel for (causal, window), as flash_attn4/_ops.py's _kernel_plan normalizes them: causal alone -> the
// causal kernel; a window (either side >= 0, -1 = unbounded, never together with causal) -> kLocal with the
// unbounded side(s) as a value past every length; neither -> no mask.
Options make_options(const at::Tensor& q, const at::Tensor& k, bool causal, int64_t window_left, int64_t window_right,
                     double softcap, const OptTensor& cu_q, const OptTensor& cu_k, const OptTensor& used_q,
                     const OptTensor& used_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  Options o;
  o.packed = cu_q.has_value();
  TORCH_CHECK(cu_k.has_value() == o.packed, "flash_attn4: pass both cu_seqlens_q and cu_seqlens_k, or neither");
  if (o.packed) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "flash_attn4: packed q, k, v must be 3-D (total, heads, head_dim)");
    o.batch = int(cu_q->numel()) - 1;
    TORCH_CHECK(o.batch >= 1 && o.batch <= 65535, "flash_attn4: cu_seqlens must hold 2..65536 offsets");
    o.cu_q = check_index(cu_q, o.batch + 1, q, "cu_seqlens_q");
    o.cu_k = check_index(cu_k, o.batch + 1, q, "cu_seqlens_k");
    // No sequence is longer than the packed tensor, so a generous bound is cut there (it sizes the grid).
    TORCH_CHECK(max_seqlen_q >= 1 && max_seqlen_k >= 1, "flash_attn4: max_seqlen_q/k must be >= 1");
    o.seqlen_q = int(std::min<int64_t>(max_seqlen_q, q.size(0)));
    o.seqlen_k = int(std::min<int64_t>(max_seqlen_k, k.size(0)));
    o.total_q = int(q.size(0)), o.total_k = int(k.size(0));
  } else {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "flash_attn4: q, k, v must be 4-D (batch, seqlen, heads, head_dim)");
    TORCH_CHECK(!used_q.has_value() && !used_k.has_value(), "flash_attn4: seqused_q/k need cu_seqlens");
    o.batch = int(q.size(0)), o.seqlen_q = int(q.size(1)), o.seqlen_k = int(k.size(1));
  }
  o.used_q = check_index(used_q, o.batch, q, "seqused_q");
  o.used_k = check_index(used_k, o.batch, q, "seqused_k");
  TORCH_CHECK(softcap >= 0.0, "flash_attn4: softcap must be >= 0");
  o.softcap = float(softcap);
  const bool window = window_left >= 0 || window_right >= 0;
  TORCH_CHECK(!(causal && window), "flash_attn4: pass causal or a window, not both (causal is window (-1, 0))");
  const int unbounded = o.seqlen_q + o.seqlen_k + 1;
  o.causal = causal;
  o.local = window;
  if (window) {
    o.window_left = window_side(window_left, unbounded);
    o.window_right = window_side(window_right, unbounded);
  }
  return o;
}

// tools/trace_tiles.py hands a buffer here (set_trace); builds with -DFLASH4_TRACE stamp into it.
at::Tensor g_trace;

template <class P>
void set_device_fields(P& p, const at::Tensor& q) {
  p.num_sms = num_sms(q);
  p.smem_per_block = smem_per_block(q);
  p.trace = g_trace.defined() && g_trace.device() == q.device()
                ? reinterpret_cast<unsigned long long*>(g_trace.data_ptr<int64_t>())
                : nullptr;
}

void set_trace(const OptTensor& buf) {
  TORCH_CHECK(!buf.has_value() || (buf->is_cuda() && buf->scalar_type() == at::kLong && buf->is_contiguous()),
              "flash_attn4: the trace buffer must be a contiguous int64 CUDA tensor");
  g_trace = buf.has_value() ? *buf : at::Tensor();
}

template <class P>
void set_options(P& p, const Options& o) {
  p.window_left = o.window_left, p.window_right = o.window_right;
  p.softcap = o.softcap;
  p.cu_seqlens_q = o.cu_q, p.cu_seqlens_k = o.cu_k, p.seqused_q = o.used_q, p.seqused_k = o.used_k;
  p.total_q = o.total_q, p.total_k = o.total_k;
  p.batch = o.batch, p.seqlen_q = o.seqlen_q, p.seqlen_k = o.seqlen_k;
}

std::string mask_name(const Options& o) { return o.local ? "window" : o.causal ? "causal" : "no mask"; }

// Strides of a (batch, seqlen, heads, d) tensor, or of a packed (total, heads, d) one (batch stride 0).
struct Strides {
  int64_t batch, row, head;
};
Strides strides(const at::Tensor& t) {
  return t.dim() == 4 ? Strides{t.stride(0), t.stride(1), t.stride(2)} : Strides{0, t.stride(0), t.stride(1)};
}

// A block mask's lists (flash_attn4/block_mask.py) into `b`: counts (B, H, rows) and indices (B, H, rows, len)
// int32 on q's device, B / H 1 (broadcast) or the call's. Forward: rows = nq query blocks, len = nk key
// blocks (128-token blocks of seqlen_q / seqlen_k); backward (transposed): rows = nk, len = nq. Values are
// not read here (the kernels clamp them).
bool set_block_sparse(flash4::BlockSparseParams& b, const OptTensor& kv_count, const OptTensor& kv_index,
                      const OptTensor& full_count, const OptTensor& full_index, const Options& o, int64_t nheads_q,
                      const at::Tensor& q, bool transposed) {
  const int given = kv_count.has_value() + kv_index.has_value() + full_count.has_value() + full_index.has_value();
  if (given == 0) return false;
  TORCH_CHECK(given == 4, "flash_attn4: a block mask needs all four lists (kv_count/index, full_count/index)");
  TORCH_CHECK(!o.packed, "flash_attn4: the block-sparse kernels take fixed-length batches (no cu_seqlens)");
  const int64_t nq_blocks = (o.seqlen_q + flash4::kMaskBlock - 1) / flash4::kMaskBlock;
  const int64_t nk_blocks = (o.seqlen_k + flash4::kMaskBlock - 1) / flash4::kMaskBlock;
  const int64_t rows = transposed ? nk_blocks : nq_blocks, len = transposed ? nq_blocks : nk_blocks;
  auto check = [&](const at::Tensor& t, const char* name, int dims, int64_t last) {
    TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kInt && t.dim() == dims &&
                    (t.size(0) == 1 || t.size(0) == o.batch) && (t.size(1) == 1 || t.size(1) == nheads_q) &&
                    t.size(2) == rows && t.size(dims - 1) == last && (last == 1 || t.stride(dims - 1) == 1),
                std::string("flash_attn4: block mask ") + name + " must be an int32 tensor on q's device of shape (" +
                    "1 or " + str(o.batch) + ", 1 or " + str(nheads_q) + ", " + str(rows) +
                    (dims == 4 ? ", " + str(len) : std::string()) + ") with a contiguous last dim, got " +
                    str(t.sizes()));
  };
  check(*kv_count, "kv_count", 3, rows);
  check(*full_count, "full_count", 3, rows);
  check(*kv_index, "kv_index", 4, len);
  check(*full_index, "full_index", 4, len);
  int64_t last_element = 0;  // the kernels index the lists with 32-bit offsets
  for (int d = 0; d < 4; ++d) last_element += (kv_index->size(d) - 1) * kv_index->stride(d);
  TORCH_CHECK(last_element < (int64_t(1) << 31), "flash_attn4: block mask index lists must span < 2^31 elements");
  TORCH_CHECK(kv_count->strides() == full_count->strides() && kv_index->strides() == full_index->strides() &&
                  kv_count->sizes() == full_count->sizes() && kv_index->sizes() == full_index->sizes(),
              "flash_attn4: the partial and full block lists must share shapes and strides");
  auto bstride = [](const at::Tensor& t, int d) { return t.size(d) == 1 ? int64_t(0) : t.stride(d); };
  b.kv_count = kv_count->data_ptr<int>(), b.kv_index = kv_index->data_ptr<int>();
  b.full_count = full_count->data_ptr<int>(), b.full_index = full_index->data_ptr<int>();
  b.count_batch_stride = bstride(*kv_count, 0), b.count_head_stride = bstride(*kv_count, 1);
  b.count_row_stride = kv_count->stride(2);
  b.index_batch_stride = bstride(*kv_index, 0), b.index_head_stride = bstride(*kv_index, 1);
  b.index_row_stride = kv_index->stride(2);
  b.num_blocks = int(len);
  return true;
}

// ALiBi slopes into p: fp32 (nheads_q,) or (batch, nheads_q) on q's device, last dim contiguous; the Alibi
// kernels take no softcap. Returns whether slopes were given.
template <class P>
bool set_alibi(P& p, const OptTensor& slopes, const Options& o, int64_t nheads_q, const at::Tensor& q,
               double softmax_scale) {
  if (!slopes.has_value()) return false;
  const at::Tensor& s = *slopes;
  TORCH_CHECK(s.is_cuda() && s.device() == q.device() && s.scalar_type() == at::kFloat &&
                  (s.dim() == 1 || (s.dim() == 2 && s.size(0) == o.batch)) && s.size(-1) == nheads_q &&
                  s.stride(-1) == 1,
              "flash_attn4: alibi_slopes must be a float32 tensor on q's device of shape (" + str(nheads_q) +
                  ",) or (" + str(o.batch) + ", " + str(nheads_q) + ") with a contiguous last dim, got " +
                  str(s.sizes()));
  TORCH_CHECK(o.softcap == 0.f, "flash_attn4: the ALiBi kernels take no softcap");
  TORCH_CHECK(softmax_scale > 0.0, "flash_attn4: ALiBi needs softmax_scale > 0");
  p.alibi_slopes = s.data_ptr<float>();
  p.alibi_batch_stride = s.dim() == 2 ? s.stride(0) : 0;
  return true;
}

// Dropout into p: dropout_p in [0, 1) and rng, the call's (seed, offset) as a contiguous int64 (2,) tensor on
// q's device (flash_attn4.dropout.draw_rng_state), read by the kernels, never here. Returns whether p > 0.
template <class P>
bool set_dropout(P& p, double dropout_p, const OptTensor& rng, const Options& o, const at::Tensor& q) {
  if (dropout_p == 0.0) return false;
  TORCH_CHECK(dropout_p > 0.0 && dropout_p < 1.0, "flash_attn4: dropout_p must be in [0, 1), got " + str(dropout_p));
  TORCH_CHECK(rng.has_value() && rng->is_cuda() && rng->device() == q.device() && rng->scalar_type() == at::kLong &&
                  rng->numel() == 2 && rng->is_contiguous(),
              "flash_attn4: dropout needs dropout_rng, a contiguous int64 (2,) tensor (seed, offset) on q's device "
              "(flash_attn4.dropout.draw_rng_state)");
  TORCH_CHECK(o.softcap == 0.f, "flash_attn4: the dropout kernels take no softcap (the PyTorch reference does)");
  p.dropout.rng = rng->data_ptr<int64_t>();
  // flash_attn4.dropout.threshold and keep_scale: p rounded to a multiple of 1 / 256, and 1 / (1 - that).
  const int64_t t = std::min<int64_t>(int64_t(std::floor(dropout_p * 256.0 + 0.5)), 255);
  p.dropout.threshold = uint32_t(t);
  p.dropout.inv_keep = float(256.0 / double(256 - t));
  return true;
}

// Writes softmax(q k^T * scale + mask) v into `out` and the natural-log LSE into `lse`: (batch, hq, sq) for
// 4-D inputs, (hq, total_q) for packed ones (cu_seqlens given: q (total_q, hq, d), k/v (total_k, hk, d)).
void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
         const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k, const OptTensor& seqused_q,
         const OptTensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, int64_t kernel_arch,
         const OptTensor& block_kv_count, const OptTensor& block_kv_index, const OptTensor& block_full_count,
         const OptTensor& block_full_index, const OptTensor& alibi_slopes, const OptTensor& sinks,
         double dropout_p, const OptTensor& dropout_rng) {
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
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "flash_attn4: lse must be contiguous float32");
  const Options o = make_options(q, k, causal, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                                 seqused_q, seqused_k, max_seqlen_q, max_seqlen_k);
  const int hd = q.dim() - 2;  // heads dim
  const int64_t nheads_q = q.size(hd), head_dim = q.size(hd + 1), nheads_kv = k.size(hd);
  TORCH_CHECK(k.size(hd + 1) == head_dim && (o.packed || k.size(0) == q.size(0)),
              "flash_attn4: k must match q's batch and head_dim, got q " + str(q.sizes()) + ", k " + str(k.sizes()));
  // v may have a smaller head dim than q and k (MLA instantiations); out has v's.
  const int64_t head_dim_v = v.size(hd + 1);
  TORCH_CHECK(v.sizes().slice(0, hd + 1) == k.sizes().slice(0, hd + 1),
              "flash_attn4: v must have k's shape but in the last dim, " + str(k.sizes()) + ", got " +
                  str(v.sizes()));
  TORCH_CHECK(nheads_kv > 0 && nheads_q % nheads_kv == 0, "flash_attn4: nheads_q (" + str(nheads_q) +
                                                              ") must be a multiple of nheads_kv (" +
                                                              str(nheads_kv) + ")");
  TORCH_CHECK(out.sizes().slice(0, hd + 1) == q.sizes().slice(0, hd + 1) && out.size(hd + 1) == head_dim_v,
              "flash_attn4: out must have q's shape with v's head dim, got " + str(out.sizes()));
  if (o.packed) {
    TORCH_CHECK(lse.dim() == 2 && lse.size(0) == nheads_q && lse.size(1) == q.size(0),
                "flash_attn4: packed lse must be (nheads_q, total_q)");
  } else {
    TORCH_CHECK(lse.dim() == 3 && lse.size(0) == o.batch && lse.size(1) == nheads_q && lse.size(2) == o.seqlen_q,
                "flash_attn4: lse must be a contiguous float32 tensor of shape (batch, nheads_q, seqlen_q)");
  }
  TORCH_CHECK(o.seqlen_q >= 1 && o.seqlen_k >= 1 && o.batch >= 1, "flash_attn4: empty inputs are handled in Python");
  // Grid limits (y = heads, z = batch) and 32-bit TMA coordinates.
  TORCH_CHECK(o.batch <= 65535 && nheads_q <= 65535, "flash_attn4: batch and nheads_q must be <= 65535");
  TORCH_CHECK(q.size(hd - 1) < (int64_t(1) << 30) && k.size(hd - 1) < (int64_t(1) << 30),
              "flash_attn4: sequence lengths must be < 2^30");
  check_tma_layout(q, "q");
  check_tma_layout(k, "k");
  check_tma_layout(v, "v");
  check_tma_layout(out, "out");

  const DType kdtype = dtype == at::kBFloat16 ? DType::kBF16 : DType::kFP16;
  check_kernel_arch(q, kernel_arch);
  flash4::FwdParams p;
  const bool sparse = set_block_sparse(p.block_sparse, block_kv_count, block_kv_index, block_full_count,
                                       block_full_index, o, nheads_q, q, /*transposed=*/false);
  const bool alibi = set_alibi(p, alibi_slopes, o, nheads_q, q, softmax_scale);
  const bool dropout = set_dropout(p, dropout_p, dropout_rng, o, q);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->is_cuda() && sinks->device() == q.device() && sinks->scalar_type() == at::kFloat &&
                    sinks->dim() == 1 && sinks->numel() == nheads_q && sinks->is_contiguous(),
                "flash_attn4: sinks must be a contiguous float32 (" + str(nheads_q) + ",) tensor on q's device");
    p.sinks = sinks->data_ptr<float>();
  }
  const flash4::FwdKernelEntry* entry = flash4::find_fwd_kernel(int(kernel_arch), kdtype, int(head_dim), o.causal,
                                                                o.local, sparse, alibi, dropout, int(head_dim_v));
  TORCH_CHECK(entry != nullptr, "flash_attn4: no compiled " + std::string(sparse ? "block-sparse " : "") +
                                    (alibi ? "ALiBi " : "") + (dropout ? "dropout " : "") +
                                    "forward kernel for sm" + str(kernel_arch) + ", " +
                                    (kdtype == DType::kBF16 ? "bf16" : "fp16") + ", head_dim " + str(head_dim) +
                                    (head_dim_v != head_dim ? " (v " + str(head_dim_v) + ")" : "") + ", " +
                                    mask_name(o) +
                                    ". Rebuild with that head dim/dtype in FLASH_ATTN4_HDIMS / FLASH_ATTN4_DTYPES.");

  set_options(p, o);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  const Strides sq = strides(q), sk = strides(k), sv = strides(v), so = strides(out);
  p.q_batch_stride = sq.batch, p.q_row_stride = sq.row, p.q_head_stride = sq.head;
  p.k_batch_stride = sk.batch, p.k_row_stride = sk.row, p.k_head_stride = sk.head;
  p.v_batch_stride = sv.batch, p.v_row_stride = sv.row, p.v_head_stride = sv.head;
  p.o_batch_stride = so.batch, p.o_row_stride = so.row, p.o_head_stride = so.head;
  p.lse_batch_stride = o.packed ? 0 : nheads_q * o.seqlen_q;
  p.lse_head_stride = o.packed ? q.size(0) : o.seqlen_q;
  p.nheads_q = int(nheads_q);
  p.nheads_kv = int(nheads_kv);
  p.head_dim = int(head_dim);
  p.softmax_scale = float(softmax_scale);
  p.softmax_scale_log2 = float(softmax_scale * M_LOG2E);
  p.dtype = kdtype;
  set_device_fields(p, q);
  // FLASH_ATTN4_FP16_ACCUM=1: the Ampere path's fp16 forward accumulates P V in fp16 (params.h). Read on every
  // call, like FLASH_ATTN4_SMEM_CAP.
  p.accum_pv_fp16 = kernel_arch == 80 && kdtype == DType::kFP16 && env_flag("FLASH_ATTN4_FP16_ACCUM");

  const c10::cuda::CUDAGuard guard(q.device());
  entry->launch(p, at::cuda::getCurrentCUDAStream().stream());
}

// Gradients of fwd: writes dq (like q), dk and dv (like k and v; summed over each GQA group's query heads).
// Uses fp32 scratch allocated here (dq_accum zeroed, D, lse in log2 units), rows padded to a multiple of 128
// (packed batches: each sequence from a multiple of 128, see flash4::padded_row_offset).
// deterministic: key blocks add into dq in a fixed order (bitwise-reproducible dq; dk and dv always are).
// dlse: gradient of lse (return_lse), or None for zero. Options as for fwd.
// Returns the pre-pass's D - dlse (D = rowsum(dout * out)), fp32 (slices, padded rows) as laid out above: the
// sinks' gradient is a weighted sum of it, which saves the caller a pass over out and dout.
at::Tensor bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
         double softmax_scale, bool causal, bool deterministic, const OptTensor& dlse, int64_t window_left,
         int64_t window_right, double softcap, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
         const OptTensor& seqused_q, const OptTensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
         int64_t kernel_arch, const OptTensor& block_q_count, const OptTensor& block_q_index,
         const OptTensor& block_full_q_count, const OptTensor& block_full_q_index, const OptTensor& alibi_slopes,
         double dropout_p, const OptTensor& dropout_rng) {
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
  const Options o = make_options(q, k, causal, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                                 seqused_q, seqused_k, max_seqlen_q, max_seqlen_k);
  const int hd = q.dim() - 2;
  const int64_t nheads_q = q.size(hd), head_dim = q.size(hd + 1), nheads_kv = k.size(hd);
  // v (and out, dout, dv) may have a smaller head dim than q and k (MLA instantiations).
  const int64_t head_dim_v = v.size(hd + 1);
  TORCH_CHECK(k.size(hd + 1) == head_dim && v.sizes().slice(0, hd + 1) == k.sizes().slice(0, hd + 1) &&
                  (o.packed || k.size(0) == q.size(0)),
              "flash_attn4: k and v must match q's batch and head_dim (v: but in the last dim), got " +
                  str(k.sizes()) + " and " + str(v.sizes()));
  TORCH_CHECK(nheads_kv > 0 && nheads_q % nheads_kv == 0, "flash_attn4: nheads_q (" + str(nheads_q) +
                                                              ") must be a multiple of nheads_kv (" +
                                                              str(nheads_kv) + ")");
  TORCH_CHECK(out.sizes() == dout.sizes() && out.sizes().slice(0, hd + 1) == q.sizes().slice(0, hd + 1) &&
                  out.size(hd + 1) == head_dim_v && dq.sizes() == q.sizes(),
              "flash_attn4: dq must have q's shape " + str(q.sizes()) + ", out and dout q's with v's head dim");
  TORCH_CHECK(dk.sizes() == k.sizes() && dv.sizes() == v.sizes(),
              "flash_attn4: dk and dv must have k's and v's shapes " + str(k.sizes()) + ", " + str(v.sizes()));
  const std::vector<int64_t> lse_shape =
      o.packed ? std::vector<int64_t>{nheads_q, q.size(0)} : std::vector<int64_t>{o.batch, nheads_q, o.seqlen_q};
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.sizes() == at::IntArrayRef(lse_shape),
              "flash_attn4: lse must be the forward's contiguous float32 " + str(lse_shape) + " tensor");
  TORCH_CHECK(o.seqlen_q >= 1 && o.seqlen_k >= 1 && o.batch >= 1, "flash_attn4: empty inputs are handled in Python");
  if (dlse.has_value()) {
    TORCH_CHECK(dlse->is_cuda() && dlse->device() == q.device() && dlse->scalar_type() == at::kFloat &&
                    dlse->is_contiguous() && dlse->sizes() == lse.sizes(),
                "flash_attn4: dlse must be a contiguous float32 tensor shaped like lse, on q's device");
  }
  TORCH_CHECK(o.batch <= 65535 && nheads_q <= 65535, "flash_attn4: batch and nheads_q must be <= 65535");
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
  check_kernel_arch(q, kernel_arch);
  flash4::BwdParams p;
  const bool sparse = set_block_sparse(p.block_sparse, block_q_count, block_q_index, block_full_q_count,
                                       block_full_q_index, o, nheads_q, q, /*transposed=*/true);
  TORCH_CHECK(!(sparse && deterministic), "flash_attn4: the block-sparse backward has no deterministic mode");
  const bool alibi = set_alibi(p, alibi_slopes, o, nheads_q, q, softmax_scale);
  const bool dropout = set_dropout(p, dropout_p, dropout_rng, o, q);
  const flash4::BwdKernelEntry* entry = flash4::find_bwd_kernel(int(kernel_arch), kdtype, int(head_dim), o.causal,
                                                                o.local, sparse, alibi, dropout, int(head_dim_v));
  TORCH_CHECK(entry != nullptr, "flash_attn4: no compiled " + std::string(sparse ? "block-sparse " : "") +
                                    (alibi ? "ALiBi " : "") + (dropout ? "dropout " : "") +
                                    "backward kernel for sm" + str(kernel_arch) + ", " +
                                    (kdtype == DType::kBF16 ? "bf16" : "fp16") + ", head_dim " + str(head_dim) +
                                    (head_dim_v != head_dim ? " (v " + str(head_dim_v) + ")" : "") + ", " +
                                    mask_name(o));

  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t align = flash4::kAccumRowAlign;
  const int64_t seqlen_q_rounded = (o.seqlen_q + align - 1) / align * align;
  // Rows of scratch per (batch, head) slice: fixed-length seqlen_q_rounded; packed, every sequence from a
  // multiple of kAccumRowAlign, all sequences of a head in one slice.
  const int64_t accum_rows = o.packed ? (q.size(0) + int64_t(o.batch) * align + align - 1) / align * align
                                      : seqlen_q_rounded;
  const int64_t slices = o.packed ? nheads_q : int64_t(o.batch) * nheads_q;
  auto f32 = q.options().dtype(at::kFloat);
  // Zeroed by a fill kernel (full bandwidth); the main kernel adds every key block's dQ into it. Past the
  // scratch, 16 bytes more hold BwdParams::tile_counter, zeroed by the same fill.
  const int64_t accum_numel = slices * accum_rows * head_dim;
  at::Tensor dq_accum = at::zeros({accum_numel + 4}, f32);
  at::Tensor dpsum = at::empty({slices, accum_rows}, f32);
  at::Tensor lse_log2 = at::empty({slices, accum_rows}, f32);
  // One turn counter per query block, zeroed: see BwdParams::dq_semaphore. Sized for the smallest kBlockM of
  // any backward kernel (32: the sm80 kernel at head dims > 128); kernels with larger blocks use fewer.
  at::Tensor dq_semaphore =
      deterministic ? at::zeros({slices, accum_rows / 32}, q.options().dtype(at::kInt)) : at::Tensor();

  set_options(p, o);
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.out = out.data_ptr(), p.dout = dout.data_ptr();
  const Strides sq = strides(q), sk = strides(k), sv = strides(v), so = strides(out), sdo = strides(dout);
  const Strides sdq = strides(dq), sdk = strides(dk), sdv = strides(dv);
  p.q_batch_stride = sq.batch, p.q_row_stride = sq.row, p.q_head_stride = sq.head;
  p.k_batch_stride = sk.batch, p.k_row_stride = sk.row, p.k_head_stride = sk.head;
  p.v_batch_stride = sv.batch, p.v_row_stride = sv.row, p.v_head_stride = sv.head;
  p.out_batch_stride = so.batch, p.out_row_stride = so.row, p.out_head_stride = so.head;
  p.dout_batch_stride = sdo.batch, p.dout_row_stride = sdo.row, p.dout_head_stride = sdo.head;
  p.lse = lse.data_ptr<float>();
  p.dlse = dlse.has_value() ? dlse->data_ptr<float>() : nullptr;
  p.lse_batch_stride = o.packed ? 0 : nheads_q * o.seqlen_q;
  p.lse_head_stride = o.packed ? q.size(0) : o.seqlen_q;
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  p.dq_batch_stride = sdq.batch, p.dq_row_stride = sdq.row, p.dq_head_stride = sdq.head;
  p.dk_batch_stride = sdk.batch, p.dk_row_stride = sdk.row, p.dk_head_stride = sdk.head;
  p.dv_batch_stride = sdv.batch, p.dv_row_stride = sdv.row, p.dv_head_stride = sdv.head;
  p.dq_accum = dq_accum.data_ptr<float>();
  p.tile_counter = reinterpret_cast<int*>(p.dq_accum + accum_numel);
  p.dpsum = dpsum.data_ptr<float>();
  p.lse_log2 = lse_log2.data_ptr<float>();
  p.dq_semaphore = deterministic ? dq_semaphore.data_ptr<int>() : nullptr;
  p.seqlen_q_rounded = int(seqlen_q_rounded);
  p.accum_batch_stride = o.packed ? 0 : nheads_q * accum_rows;
  p.accum_head_stride = accum_rows;
  p.nheads_q = int(nheads_q), p.nheads_kv = int(nheads_kv), p.head_dim = int(head_dim);
  p.softmax_scale = float(softmax_scale);
  p.softmax_scale_log2 = float(softmax_scale * M_LOG2E);
  p.dtype = kdtype;
  set_device_fields(p, q);
  entry->launch(p, at::cuda::getCurrentCUDAStream().stream());
  return dpsum;
}

std::vector<std::string> compiled_kernels() {
  std::vector<std::string> names;
  for (int i = 0; i < flash4::kNumFwdKernels; ++i) names.emplace_back(flash4::kFwdKernels[i].name);
  for (int i = 0; i < flash4::kNumBwdKernels; ++i) names.emplace_back(flash4::kBwdKernels[i].name);
  for (int i = 0; i < flash4::kNumDecodeKernels; ++i) names.emplace_back(flash4::kDecodeKernels[i].name);
  return names;
}

}  // namespace

namespace flash4::binding {
void register_decode(pybind11::module_& m);  // decode_api.cpp
void register_fp8(pybind11::module_& m);     // fp8_api.cpp
void register_sparse(pybind11::module_& m);  // sparse_api.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_attn4 CUDA kernels (use flash_attn4.attn, not this module directly)";
  m.def("fwd", &fwd, "Attention forward into preallocated out/lse", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"), py::arg("window_left") = -1,
        py::arg("window_right") = -1, py::arg("softcap") = 0.0, py::arg("cu_seqlens_q") = py::none(),
        py::arg("cu_seqlens_k") = py::none(), py::arg("seqused_q") = py::none(), py::arg("seqused_k") = py::none(),
        py::arg("max_seqlen_q") = 0, py::arg("max_seqlen_k") = 0, py::arg("kernel_arch") = 0,
        py::arg("block_kv_count") = py::none(), py::arg("block_kv_index") = py::none(),
        py::arg("block_full_count") = py::none(), py::arg("block_full_index") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("dropout_p") = 0.0,
        py::arg("dropout_rng") = py::none());
  m.def("bwd", &bwd, "Attention backward into preallocated dq/dk/dv", py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("deterministic") = false, py::arg("dlse") = py::none(),
        py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
        py::arg("cu_seqlens_q") = py::none(), py::arg("cu_seqlens_k") = py::none(), py::arg("seqused_q") = py::none(),
        py::arg("seqused_k") = py::none(), py::arg("max_seqlen_q") = 0, py::arg("max_seqlen_k") = 0,
        py::arg("kernel_arch") = 0, py::arg("block_q_count") = py::none(), py::arg("block_q_index") = py::none(),
        py::arg("block_full_q_count") = py::none(), py::arg("block_full_q_index") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("dropout_p") = 0.0, py::arg("dropout_rng") = py::none());
  flash4::binding::register_decode(m);
  flash4::binding::register_fp8(m);
  flash4::binding::register_sparse(m);
  m.def("compiled_kernels", &compiled_kernels, "Names of the kernel instantiations in this build");
  m.def("set_trace", &set_trace, "Per-CTA profiling buffer for builds with -DFLASH4_TRACE (None: off)",
        py::arg("buf") = py::none());
  m.def("trace_slots", [] { return flash4::kTraceSlots; },
        "int64 words per CTA in the trace buffer (common/trace.hpp)");
}
