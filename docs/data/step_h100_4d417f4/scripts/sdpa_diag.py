"""Why SDPA is slow in the 125M step's prefix blocks: the layouts it gets and the kernel torch picks."""

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from recipes import load_config
from ttt.models.transformer import Block, rope_cos_sin

cfg = load_config(["recipe=ttt_e2e_125m"]).model
cfg.attention = "sdpa"
block = Block(cfg).cuda()
print(type(cfg).__name__)
x = torch.randn(4, 8192, cfg.d_model, device="cuda", requires_grad=True)
cos, sin = rope_cos_sin(8192, cfg.resolved().head_dim, cfg.rope_theta, torch.device("cuda"))
seen = []
real = F.scaled_dot_product_attention


def spy(q, k, v, **kw):
    if not seen:
        seen.append(1)
        for n, t in zip("qkv", (q, k, v)):
            print(n, tuple(t.shape), t.stride(), t.dtype, t.is_contiguous(), flush=True)
        print(
            "kwargs",
            {k_: v_ for k_, v_ in kw.items() if k_ != "attn_mask"},
            "mask",
            kw.get("attn_mask") is not None,
        )
        try:
            print(
                "choice",
                SDPBackend(
                    torch._fused_sdp_choice(
                        q,
                        k,
                        v,
                        None,
                        0.0,
                        kw.get("is_causal", False),
                        scale=kw.get("scale"),
                        enable_gqa=kw.get("enable_gqa", False),
                    )
                ),
            )
        except Exception as e:
            print("choice failed", e)
        for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            with warnings.catch_warnings(record=True) as caught, sdpa_kernel(be):
                warnings.simplefilter("always")
                try:
                    real(q, k, v, **kw)
                    print(be.name, "ok")
                except Exception as e:
                    print(be.name, "refused:", str(e)[:200])
                for w in caught:
                    print("   warn:", str(w.message)[:300])
    return real(q, k, v, **kw)


F.scaled_dot_product_attention = spy
with torch.autocast("cuda", dtype=torch.bfloat16):
    try:
        y = block(x, cos, sin)
    except TypeError:
        import inspect

        print(inspect.signature(rope_cos_sin))
        raise
