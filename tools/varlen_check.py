"""Small packed-batch (varlen) forward + backward set for compute-sanitizer on a GPU: mixed lengths
including 0 and 1 (and a sequence with queries but no keys), GQA 6:2, causal, none, window (40, 3) + softcap,
deterministic and not, at hdim 64 and 128; prints the largest error of out, dq, dk, dv against the fp32
reference so a silent error also shows. FLASH_ATTN4_FORCE_SM80=1 runs the Ampere-path kernels.

    compute-sanitizer --tool memcheck python3 tools/varlen_check.py
"""

import torch

import flash_attn4
from flash_attn4 import reference

torch.manual_seed(0)
dev = "cuda"
for hdim in (64, 128):
    for kw in ({"causal": False}, {"causal": True}, {"window_size": (40, 3), "softcap": 4.0}):
        for det in (False, True):
            lq = [0, 1, 113, 203, 7]
            lk = [5, 1, 130, 203, 0]
            cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device=dev)
            ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device=dev)
            q = torch.randn(sum(lq), 6, hdim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(sum(lk), 2, hdim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(sum(lk), 2, hdim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            out = flash_attn4.attn_varlen(q, k, v, cq, ck, max(lq), max(lk), deterministic=det, **kw)
            g = torch.randn_like(out)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            ro = reference.attention_varlen_ref(qf, kf, vf, cq, ck, **kw)
            ro = ro[0] if isinstance(ro, tuple) else ro
            rdq, rdk, rdv = torch.autograd.grad(ro, (qf, kf, vf), g.float())
            pairs = ((out, ro), (dq, rdq), (dk, rdk), (dv, rdv))
            errs = [(a.float() - b).abs().max().item() for a, b in pairs]
            print(f"hdim {hdim} {kw} det={det}: max err out/dq/dk/dv " + " ".join(f"{e:.3g}" for e in errs))
torch.cuda.synchronize()
print("done")
