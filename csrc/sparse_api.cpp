// Binding of estimate_block_mask's GPU path (sparse_estimate.cu): block means of q and k, then the row and
// column lists of the BlockMask, all in one call so the host pays for one Python call instead of ~50 ops.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <string>
#include <vector>

#include "binding_common.h"
#include "sparse_estimate.h"

namespace flash4::binding {
namespace {

MeansArgs::DType means_dtype(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return MeansArgs::kF32;
    case at::kHalf: return MeansArgs::kF16;
    case at::kBFloat16: return MeansArgs::kBF16;
    default: TORCH_CHECK(false, "flash_attn4: estimate_blocks takes float32, float16 or bfloat16 q and k");
  }
}

at::Tensor block_means(const at::Tensor& x_in, int64_t block, cudaStream_t stream) {
  const at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const int64_t batch = x.size(0), s = x.size(1), heads = x.size(2), d = x.size(3), n = (s + block - 1) / block;
  at::Tensor out = at::empty({batch, n, heads, d}, x.options().dtype(at::kFloat));
  MeansArgs a{x.data_ptr(), out.data_ptr<float>(), means_dtype(x), int(batch), int(s), int(n), int(heads), int(d),
              int(block), x.stride(0), x.stride(1), x.stride(2)};
  launch_block_means(a, stream);
  return out;
}

// The lists of BlockMask in its field order: kv_count, kv_index, full_count, full_index, q_count, q_index,
// full_q_count, full_q_index (flash_attn4/block_mask.py). threshold <= 0 selects density.
std::vector<at::Tensor> estimate_blocks(const at::Tensor& q, const at::Tensor& k, double softmax_scale,
                                        double threshold, double density, int64_t keep_first, int64_t keep_local,
                                        int64_t window_left, int64_t window_right, int64_t block) {
  TORCH_CHECK(q.is_cuda() && k.device() == q.device(), "flash_attn4: q and k must be on one CUDA device");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(3) == k.size(3),
              "flash_attn4: q must be (batch, seqlen_q, nheads_q, d) and k (batch, seqlen_k, nheads_kv, d)");
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3), sk = k.size(1), hk = k.size(2);
  TORCH_CHECK(hk > 0 && hq % hk == 0, "flash_attn4: nheads of q must be a multiple of nheads of k");
  TORCH_CHECK(block > 0 && sq > 0 && sk > 0 && batch > 0, "flash_attn4: estimate_blocks needs non-empty q and k");
  TORCH_CHECK((threshold > 0) != (density > 0), "flash_attn4: exactly one of threshold and density");
  const int64_t nq = (sq + block - 1) / block, nk = (sk + block - 1) / block;
  TORCH_CHECK(estimate_smem_bytes(int(nk), int(d)) <= 48 * 1024,
              "flash_attn4: estimate_blocks holds a row of " + str(nk) + " key blocks in shared memory (at most " +
                  str(48 * 1024 / 4 - d) + ")");
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const at::Tensor q_mean = block_means(q, block, stream), k_mean = block_means(k, block, stream);

  // One int32 buffer for the eight lists (one allocation), viewed in pieces.
  const int64_t rows = batch * hq * nq, cols = batch * hq * nk, cells = rows * nk;
  at::Tensor lists = at::empty({2 * rows + 2 * cols + 4 * cells}, q.options().dtype(at::kInt));
  at::Tensor dense = at::empty({2 * cells}, q.options().dtype(at::kByte));
  int64_t at = 0;
  auto take = [&](at::IntArrayRef shape, int64_t numel) {
    at::Tensor t = lists.narrow(0, at, numel).view(shape);
    at += numel;
    return t;
  };
  std::vector<at::Tensor> out = {
      take({batch, hq, nq}, rows),     take({batch, hq, nq, nk}, cells), take({batch, hq, nq}, rows),
      take({batch, hq, nq, nk}, cells), take({batch, hq, nk}, cols),     take({batch, hq, nk, nq}, cells),
      take({batch, hq, nk}, cols),     take({batch, hq, nk, nq}, cells)};

  EstimateParams p{};
  p.q_mean = q_mean.data_ptr<float>(), p.k_mean = k_mean.data_ptr<float>(), p.dense = dense.data_ptr<uint8_t>();
  p.kv_count = out[0].data_ptr<int32_t>(), p.kv_index = out[1].data_ptr<int32_t>();
  p.full_count = out[2].data_ptr<int32_t>(), p.full_index = out[3].data_ptr<int32_t>();
  p.q_count = out[4].data_ptr<int32_t>(), p.q_index = out[5].data_ptr<int32_t>();
  p.full_q_count = out[6].data_ptr<int32_t>(), p.full_q_index = out[7].data_ptr<int32_t>();
  p.batch = int(batch), p.hq = int(hq), p.hk = int(hk), p.d = int(d), p.sq = int(sq), p.sk = int(sk);
  p.block = int(block), p.nq = int(nq), p.nk = int(nk);
  p.scale = float(softmax_scale);
  p.threshold = float(threshold - 1e-6);  // the PyTorch version's comparison, in fp32 as there
  p.density = threshold > 0 ? 0.0 : density;
  p.keep_first = int(keep_first), p.keep_local = int(keep_local);
  p.left = window_left, p.right = window_right;
  launch_estimate_blocks(p, stream);
  return out;
}

}  // namespace

void register_sparse(pybind11::module_& m) {
  m.def("estimate_blocks", &estimate_blocks,
        "estimate_block_mask's lists from q and k (see flash_attn4/sparsity.py)", py::arg("q"), py::arg("k"),
        py::arg("softmax_scale"), py::arg("threshold"), py::arg("density"), py::arg("keep_first"),
        py::arg("keep_local"), py::arg("window_left"), py::arg("window_right"), py::arg("block"));
}

}  // namespace flash4::binding
