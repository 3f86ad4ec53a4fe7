"""Shared pieces of the kernel tests: the case table, random inputs, and the float64 reference
computed by autograd through plain attention (independent of the stage formulas under test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashbob.reference import attention_naive

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    heads_q: int
    heads_kv: int
    n: int
    m: int
    d: int
    causal: bool = False
    window: int | None = None

    @property
    def id(self) -> str:
        mask = f"window{self.window}" if self.window else "causal" if self.causal else "full"
        kv = "" if self.heads_kv == self.heads_q else f"-Hkv{self.heads_kv}"
        return f"B{self.batch}-H{self.heads_q}{kv}-N{self.n}-M{self.m}-D{self.d}-{mask}"


CASES = [
    Case(1, 2, 2, 37, 37, 16),
    Case(2, 4, 2, 37, 37, 48, causal=True),
    Case(1, 4, 1, 63, 63, 64, causal=True),
    Case(1, 2, 2, 45, 29, 80),
    Case(1, 2, 2, 29, 45, 48, causal=True),
    Case(1, 2, 2, 40, 29, 32, causal=True),
    Case(1, 2, 1, 63, 63, 16, causal=True, window=9),
    Case(1, 2, 2, 30, 50, 24, causal=True, window=17),
    Case(1, 1, 1, 1, 1, 8),
    Case(1, 1, 1, 19, 21, 256, causal=True),
]


def many_compiles(condition: bool) -> list:
    """Marks for a test variant that the 5-minute CUDA run (`-m "not many_compiles"`) leaves out:
    on CUDA each new (dtype, head dim, mask, GQA, cotangent) class compiles every kernel again
    (float32 IEEE ones for 20-77 s), so that run keeps one variant per feature. The CPU runs all."""
    return [pytest.mark.many_compiles] if condition else []


def make_inputs(case: Case, dtype=torch.float32, device=DEVICE, seed=0):
    """Random non-zero q (B,Hq,N,D), k, v (B,Hkv,M,D), dout like q, and cotangents u_q, u_k, u_v."""
    gen = torch.Generator().manual_seed(seed)
    qs = (case.batch, case.heads_q, case.n, case.d)
    ks = (case.batch, case.heads_kv, case.m, case.d)
    shapes = [qs, ks, ks, qs, qs, ks, ks]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype) for s in shapes]


def autograd_reference(case: Case, q, k, v, dout, u_q, u_k, u_v, scale=None):
    """Forward, first backward and BoB by autograd through plain attention, in float64.
    Returns dict with out, dq, dk, dv and (grad_q, grad_k, grad_v, grad_dout) for the given
    cotangents (None entries are treated as absent)."""
    scale = case.d**-0.5 if scale is None else scale
    q, k, v, dout = (t.detach().double().requires_grad_() for t in (q, k, v, dout))
    out = attention_naive(q, k, v, causal=case.causal, window=case.window, scale=scale)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    pairs = [(g, u.double()) for g, u in ((dq, u_q), (dk, u_k), (dv, u_v)) if u is not None]
    bob = torch.autograd.grad(
        [g for g, _ in pairs], (q, k, v, dout), [u for _, u in pairs], allow_unused=True
    )
    bob = [torch.zeros_like(x) if b is None else b for b, x in zip(bob, (q, k, v, dout))]
    return {"out": out.detach(), "dq": dq.detach(), "dk": dk.detach(), "dv": dv.detach(), "bob": bob}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (absolute norm of x when ref is zero); NaN stays NaN."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref.norm()
    diff = (x - ref).norm()
    return float(diff / denom) if denom > 0 else float(diff)
