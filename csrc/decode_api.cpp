// Binding of the decode path (KV caches, split-KV): argument checks, DecodeParams / AppendParams from tensors,
// scratch for the splits, dispatch. Values on the device (lengths, page ids, batch indices) are never read here
// (that would synchronize); the kernels clamp them (decode/kv_source.hpp).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <string>
#include <tuple>

#include "binding_common.h"
#include "common/decode_splits.h"
#include "common/tile_size.h"
#include "dispatch.h"
#include "params.h"

namespace flash4::binding {
namespace {

const int* check_int_vector(const OptTensor& t, int64_t numel, const at::Tensor& q, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->device() == q.device() && t->scalar_type() == at::kInt && t->dim() == 1 &&
                  t->numel() == numel && t->is_contiguous(),
              std::string("flash_attn4: ") + name + " must be a contiguous int32 CUDA tensor of " + str(numel) +
                  " elements (one per sequence) on q's device");
  return t->data_ptr<int>();
}

// Forward over a KV cache into out / lse; see flash_attn4/_ops_kvcache.py for the semantics. k_new / v_new
// (batch, seqlen_new, nheads_kv, d) are first written into the cache at cache_seqlens (in place), rotated by
// rotary_cos / rotary_sin when given (q too). num_splits: 0 = choose (decode_num_splits), else forced (<= 128).
// e4m3 caches (q and out 16-bit): k_descale / v_descale fp32 (batch, nheads_kv) or None (1); appended k / v
// come in the caches' dtype; no rotary. Returns the number of splits used.
int64_t decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
               at::Tensor& lse, const OptTensor& k_new, const OptTensor& v_new, const OptTensor& cache_seqlens,
               const OptTensor& page_table, const OptTensor& cache_batch_idx, const OptTensor& cache_leftpad,
               const OptTensor& rotary_cos, const OptTensor& rotary_sin, bool rotary_interleaved, double softmax_scale,
               bool causal, int64_t window_left, int64_t window_right, double softcap, int64_t num_splits,
               const OptTensor& k_descale, const OptTensor& v_descale) {
  TORCH_CHECK(q.is_cuda() && k_cache.device() == q.device() && v_cache.device() == q.device() &&
                  out.device() == q.device() && lse.device() == q.device(),
              "flash_attn4: q, caches, out and lse must be on one CUDA device");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "flash_attn4: q must be bfloat16 or float16");
  const auto cache_dtype = k_cache.scalar_type();
  const bool kv8 = cache_dtype == at::kFloat8_e4m3fn;
  TORCH_CHECK((cache_dtype == dtype || kv8) && v_cache.scalar_type() == cache_dtype && out.scalar_type() == dtype,
              "flash_attn4: q and out must share one dtype, and k_cache and v_cache q's or float8_e4m3fn");
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "flash_attn4: q and the caches must be 4-D");
  const int64_t batch = q.size(0), seqlen_q = q.size(1), nheads_q = q.size(2), d = q.size(3);
  const int64_t nheads_kv = k_cache.size(2);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "flash_attn4: k_cache and v_cache must have one shape");
  TORCH_CHECK(k_cache.size(3) == d, "flash_attn4: the caches' head_dim must be q's");
  TORCH_CHECK(nheads_kv > 0 && nheads_q % nheads_kv == 0, "flash_attn4: nheads_q must be a multiple of nheads_kv");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "flash_attn4: out must be contiguous, shaped like q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == batch &&
                  lse.size(1) == nheads_q && lse.size(2) == seqlen_q,
              "flash_attn4: lse must be a contiguous float32 (batch, nheads_q, seqlen_q) tensor");
  TORCH_CHECK(batch >= 1 && batch <= 65535 && nheads_kv <= 65535 && seqlen_q >= 1,
              "flash_attn4: batch and nheads_kv must be in [1, 65535], seqlen_q >= 1");
  check_tma_layout(q, "q");
  check_tma_layout(k_cache, "k_cache");
  check_tma_layout(v_cache, "v_cache");

  const bool paged = page_table.has_value();
  DecodeParams p;
  if (paged) {
    TORCH_CHECK(page_table->is_cuda() && page_table->device() == q.device() &&
                    page_table->scalar_type() == at::kInt && page_table->dim() == 2 &&
                    page_table->size(0) == batch && page_table->stride(1) == 1,
                "flash_attn4: page_table must be an int32 (batch, max_pages) CUDA tensor with a contiguous last dim");
    TORCH_CHECK(!cache_batch_idx.has_value(), "flash_attn4: cache_batch_idx is for contiguous caches, not paged ones");
    p.page_table = page_table->data_ptr<int>();
    p.page_table_stride = page_table->stride(0);
    p.page_size = int(k_cache.size(1));
    if ((p.page_size & (p.page_size - 1)) == 0) {
      for (p.page_shift = 0; (1 << p.page_shift) < p.page_size;) ++p.page_shift;
    }
    p.num_pages = int(k_cache.size(0));
    TORCH_CHECK(p.page_size >= 1 && page_table->size(1) * int64_t(p.page_size) < (int64_t(1) << 30),
                "flash_attn4: max_pages * page_size must be < 2^30");
    p.capacity = int(page_table->size(1) * p.page_size);
    p.cache_batch = p.num_pages;
  } else {
    TORCH_CHECK(k_cache.size(1) < (int64_t(1) << 30), "flash_attn4: the cache's seqlen must be < 2^30");
    p.capacity = int(k_cache.size(1));
    p.cache_batch = int(k_cache.size(0));
    TORCH_CHECK(cache_batch_idx.has_value() || p.cache_batch >= batch,
                "flash_attn4: the cache has fewer rows (" + str(k_cache.size(0)) + ") than q has sequences (" +
                    str(batch) + "); pass cache_batch_idx");
  }
  TORCH_CHECK(p.capacity >= 1 && p.cache_batch >= 1, "flash_attn4: empty caches are handled in Python");
  p.cache_seqlens = check_int_vector(cache_seqlens, batch, q, "cache_seqlens");
  p.cache_leftpad = check_int_vector(cache_leftpad, batch, q, "cache_leftpad");
  p.cache_batch_idx = check_int_vector(cache_batch_idx, batch, q, "cache_batch_idx");

  AppendParams a;
  at::Tensor q_rot;
  const bool append = k_new.has_value();
  TORCH_CHECK(v_new.has_value() == append, "flash_attn4: pass both k and v to append, or neither");
  if (append) {
    TORCH_CHECK(p.cache_seqlens != nullptr, "flash_attn4: appending k / v needs cache_seqlens");
    TORCH_CHECK(k_new->device() == q.device() && v_new->device() == q.device() &&
                    k_new->scalar_type() == cache_dtype && v_new->scalar_type() == cache_dtype &&
                    k_new->dim() == 4 && k_new->sizes() == v_new->sizes() &&
                    k_new->size(0) == batch && k_new->size(2) == nheads_kv && k_new->size(3) == d &&
                    k_new->stride(-1) == 1 && v_new->stride(-1) == 1,
                "flash_attn4: k and v must be (batch, seqlen_new, nheads_kv, head_dim) in the caches' dtype, last dim "
                "contiguous; got " + str(k_new->sizes()));
    p.seqlen_new = int(k_new->size(1));
    a.k_new = k_new->data_ptr(), a.v_new = v_new->data_ptr();
    a.kn_batch_stride = k_new->stride(0), a.kn_row_stride = k_new->stride(1), a.kn_head_stride = k_new->stride(2);
    a.vn_batch_stride = v_new->stride(0), a.vn_row_stride = v_new->stride(1), a.vn_head_stride = v_new->stride(2);
  }
  const bool rotary = rotary_cos.has_value();
  TORCH_CHECK(rotary_sin.has_value() == rotary, "flash_attn4: pass both rotary_cos and rotary_sin, or neither");
  TORCH_CHECK(!(rotary && kv8), "flash_attn4: rotary with fp8 caches runs on the reference (Python routes it)");
  for (const auto& [t, name, ptr] : {std::tuple{&k_descale, "k_descale", &p.k_descale},
                                     std::tuple{&v_descale, "v_descale", &p.v_descale}}) {
    if (!t->has_value()) continue;
    TORCH_CHECK(kv8, std::string("flash_attn4: ") + name + " is for float8_e4m3fn caches");
    TORCH_CHECK((*t)->device() == q.device() && (*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() &&
                    (*t)->dim() == 2 && (*t)->size(0) == batch && (*t)->size(1) == nheads_kv,
                std::string("flash_attn4: ") + name + " must be a contiguous float32 (batch, nheads_kv) tensor on "
                                                     "q's device");
    *ptr = (*t)->data_ptr<float>();
  }
  if (rotary) {
    TORCH_CHECK(rotary_cos->device() == q.device() && rotary_sin->device() == q.device() &&
                    rotary_cos->scalar_type() == dtype && rotary_sin->scalar_type() == dtype &&
                    rotary_cos->dim() == 2 && rotary_cos->sizes() == rotary_sin->sizes() &&
                    rotary_cos->is_contiguous() && rotary_sin->is_contiguous() && rotary_cos->size(0) >= 1 &&
                    2 * rotary_cos->size(1) <= d && rotary_cos->size(1) >= 1,
                "flash_attn4: rotary_cos / rotary_sin must be contiguous (seqlen_ro, rotary_dim / 2) tensors in "
                "q's dtype with rotary_dim <= head_dim");
    q_rot = at::empty_like(q, at::MemoryFormat::Contiguous);
    a.q_rot = q_rot.data_ptr();
    a.cos = rotary_cos->data_ptr(), a.sin = rotary_sin->data_ptr();
    a.rotary_dim = int(2 * rotary_cos->size(1));
    a.seqlen_ro = int(rotary_cos->size(0));
    a.interleaved = rotary_interleaved;
    a.q_per_token = causal || window_left >= 0 || window_right >= 0;
  }

  p.q = q.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k = k_cache.data_ptr(), p.v = v_cache.data_ptr();
  p.k_batch_stride = k_cache.stride(0), p.k_row_stride = k_cache.stride(1), p.k_head_stride = k_cache.stride(2);
  p.v_batch_stride = v_cache.stride(0), p.v_row_stride = v_cache.stride(1), p.v_head_stride = v_cache.stride(2);
  p.o = out.data_ptr();
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.batch = int(batch), p.seqlen_q = int(seqlen_q), p.nheads_q = int(nheads_q), p.nheads_kv = int(nheads_kv);
  p.head_dim = int(d);
  p.dtype = dtype == at::kBFloat16 ? DType::kBF16 : DType::kFP16;
  p.softmax_scale = float(softmax_scale);
  p.softmax_scale_log2 = float(softmax_scale * M_LOG2E);
  TORCH_CHECK(softcap >= 0.0, "flash_attn4: softcap must be >= 0");
  p.softcap = float(softcap);
  TORCH_CHECK(!(causal && (window_left >= 0 || window_right >= 0)) || window_right == 0,
              "flash_attn4: causal means window right = 0");
  const int unbounded = p.capacity + int(seqlen_q) + 1;
  p.window_left = window_side(window_left, unbounded);
  p.window_right = causal ? 0 : window_side(window_right, unbounded);
  p.num_sms = num_sms(q);
  p.smem_per_block = smem_per_block(q);

  const flash4::DecodeKernelEntry* entry = flash4::find_decode_kernel(p.dtype, int(d), paged, kv8);
  TORCH_CHECK(entry != nullptr, "flash_attn4: no compiled decode kernel for head_dim " + str(d) +
                                    (kv8 ? " with fp8 caches" : "") +
                                    "; rebuild with it in FLASH_ATTN4_HDIMS (fp8 caches: the fp8 option too)");

  TORCH_CHECK(seqlen_q * nheads_q < (int64_t(1) << 31), "flash_attn4: too many query rows for the decode kernel");
  const int m_blocks = decode_m_blocks(int(seqlen_q), int(nheads_q / nheads_kv));
  const int64_t ctas = int64_t(m_blocks) * nheads_kv * batch;  // before splitting
  const int n_blocks = (p.capacity + decode_tile(int(d)).block_n - 1) / decode_tile(int(d)).block_n;
  TORCH_CHECK(num_splits >= 0, "flash_attn4: num_splits must be >= 0 (0 = choose, 1 = no split)");
  const int ctas_int = int(std::min<int64_t>(ctas, INT_MAX));
  const int per_sm = decode_ctas_per_sm(paged, kv8, decode_smem_bytes(int(d), paged, kv8), p.smem_per_block);
  p.num_splits = num_splits == 0 ? decode_num_splits(ctas_int, n_blocks, p.num_sms, per_sm)
                                 : int(std::min<int64_t>({num_splits, kMaxDecodeSplits, std::max(n_blocks, 1)}));
  TORCH_CHECK(int64_t(m_blocks) * p.num_splits < (int64_t(1) << 31),
              "flash_attn4: too many query rows for the decode kernel");

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor o_accum, lse_accum;
  if (p.num_splits > 1) {
    auto f32 = q.options().dtype(at::kFloat);
    o_accum = at::empty({p.num_splits, batch, nheads_q, seqlen_q, d}, f32);
    lse_accum = at::empty({p.num_splits, batch, nheads_q, seqlen_q}, f32);
    p.o_accum = o_accum.data_ptr<float>();
    p.lse_accum = lse_accum.data_ptr<float>();
  }
  if (rotary) {  // the append kernel rotates the caller's q into q_rot, which the attention kernel reads
    a.q = q.data_ptr();
    a.q_batch_stride = q.stride(0), a.q_row_stride = q.stride(1), a.q_head_stride = q.stride(2);
    p.q = q_rot.data_ptr();
    p.q_batch_stride = q_rot.stride(0), p.q_row_stride = q_rot.stride(1), p.q_head_stride = q_rot.stride(2);
  }
  entry->launch(p, append || rotary ? &a : nullptr, at::cuda::getCurrentCUDAStream().stream());
  return p.num_splits;
}

}  // namespace

void register_decode(pybind11::module_& m) {
  m.def("decode", &decode, "Attention over a KV cache (contiguous or paged), with optional append and rotary",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("out"), py::arg("lse"), py::arg("k_new"),
        py::arg("v_new"), py::arg("cache_seqlens"), py::arg("page_table"), py::arg("cache_batch_idx"),
        py::arg("cache_leftpad"), py::arg("rotary_cos"), py::arg("rotary_sin"), py::arg("rotary_interleaved"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("window_left"), py::arg("window_right"),
        py::arg("softcap"), py::arg("num_splits"), py::arg("k_descale") = py::none(),
        py::arg("v_descale") = py::none());
}

}  // namespace flash4::binding
