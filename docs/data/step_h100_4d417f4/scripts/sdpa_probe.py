"""Which SDPA kernel runs, and how fast, at the 125M step's attention shapes (fwd+bwd, bf16)."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashbob


def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def make(b, h, n, m, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    # the model's layout: (B, N, H, D) transposed to (B, H, N, D)
    q = (
        torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        .transpose(1, 2)
        .requires_grad_()
    )
    k = (
        torch.randn(b, m, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        .transpose(1, 2)
        .requires_grad_()
    )
    v = (
        torch.randn(b, m, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        .transpose(1, 2)
        .requires_grad_()
    )
    return q, k, v


def case(name, q, k, v, attn, causal):
    do = torch.randn_like(q)

    def run():
        out = attn(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)

    try:
        fwd = timed(lambda: attn(q, k, v).sum() if False else attn(q, k, v))
        ms = timed(run)
        print(f"{name:48s} fwd {fwd:8.3f} ms  fwd+bwd {ms:8.3f} ms", flush=True)
    except Exception as exc:
        print(f"{name:48s} FAILED {type(exc).__name__}: {str(exc)[:150]}", flush=True)


for b, h, n, m in [(16, 12, 8192, 8192), (16, 12, 1024, 8192)]:
    q, k, v = make(b, h, n, m, 64)
    square = n == m
    print(f"--- B={b} H={h} N={n} M={m} D=64 causal", flush=True)
    try:
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, square, None, enable_gqa=True)
        print("default choice (enable_gqa=True):", SDPBackend(choice), flush=True)
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, square, None, enable_gqa=False)
        print("default choice (enable_gqa=False):", SDPBackend(choice), flush=True)
    except Exception as exc:
        print("choice failed", exc)
    off = m - n
    if square:
        case("flashbob", q, k, v, lambda q, k, v: flashbob.flash_attention(q, k, v, causal=True), True)
        for gqa in (True, False):
            case(
                f"sdpa default gqa={gqa}",
                q,
                k,
                v,
                lambda q, k, v, gqa=gqa: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=gqa
                ),
                True,
            )
        for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):

            def f(q, k, v, be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            case(f"sdpa {be.name}", q, k, v, f, True)
        contig = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]

        def f(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        case("sdpa CUDNN contiguous (B,H,N,D)", *contig, f, True)
    else:
        case(
            "flashbob bottom-right causal",
            q,
            k,
            v,
            lambda q, k, v: flashbob.flash_attention(q, k, v, causal=True),
            True,
        )
        from torch.nn.attention.bias import causal_lower_right

        for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):

            def f(q, k, v, be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(
                        q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2])
                    )

            case(f"sdpa {be.name} causal_lower_right", q, k, v, f, True)
    del q, k, v
    torch.cuda.empty_cache()
