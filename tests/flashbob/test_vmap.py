"""torch.func.vmap over flash_attention on the Triton path (the vmapped dim folded into the batch),
alone and under grad, jvp, grad of grad and grad of jvp, against float64 plain attention under the
same transforms, outputs poisoned."""

import pytest
import torch
from kernel_cases import DEVICE, rel_err

import flashbob
from flashbob import triton_ops
from flashbob.reference import attention_naive

TOL = 2e-5
VMAP, BATCH, HEADS_Q, HEADS_KV, N, M, D = 2, 1, 2, 1, 21, 19, 48
IN_DIMS = [(0, 0, 0), (1, None, 0), (None, 0, None)]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)


def triton_attention(q, k, v):
    return flashbob.flash_attention(q, k, v, causal=True, backend="triton")


def naive(q, k, v):
    return attention_naive(q, k, v, causal=True, scale=D**-0.5)


def batched(shape, dim, gen):
    """A random tensor of `shape` with a vmapped dim of size VMAP inserted at `dim` (none if None)."""
    if dim is not None:
        shape = (*shape[:dim], VMAP, *shape[dim:])
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE)


def inputs(in_dims, seed=0):
    """q (B, Hq, N, D), k, v (B, Hkv, M, D) and a tangent for q, each batched along its in_dim."""
    gen = torch.Generator().manual_seed(seed)
    qs, ks = (BATCH, HEADS_Q, N, D), (BATCH, HEADS_KV, M, D)
    q, k, v = (batched(s, d, gen) for s, d in zip((qs, ks, ks), in_dims))
    return q, k, v, batched(qs, in_dims[0], gen)


def loss(f):
    return lambda q, k, v: f(q, k, v).sin().sum()


def jvp_q(f):
    """(q, k, v, t_q) -> the tangent of f's output along t_q."""
    return lambda q, k, v, t_q: torch.func.jvp(lambda q_: f(q_, k, v), (q,), (t_q,))[1]


def compare(transform, in_dims, n_args=3):
    args = inputs(in_dims)[:n_args]
    got = transform(triton_attention)(*(a.float() for a in args))
    want = transform(naive)(*args)
    for g, w in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (got, want))):
        assert g.dtype == torch.float32 and rel_err(g, w) <= TOL


@pytest.mark.parametrize("in_dims", IN_DIMS, ids=str)
def test_vmap_forward(in_dims):
    compare(lambda f: torch.func.vmap(f, in_dims=in_dims), in_dims)


def test_vmap_of_grad():
    in_dims = IN_DIMS[1]
    compare(lambda f: torch.func.vmap(torch.func.grad(loss(f), argnums=(0, 1, 2)), in_dims=in_dims), in_dims)


def test_grad_of_vmap():
    in_dims = IN_DIMS[0]
    compare(lambda f: torch.func.grad(loss(torch.func.vmap(f, in_dims=in_dims)), argnums=(0, 1, 2)), in_dims)


def test_vmap_of_jvp():
    in_dims = IN_DIMS[1]
    compare(lambda f: torch.func.vmap(jvp_q(f), in_dims=(*in_dims, in_dims[0])), in_dims, n_args=4)


def test_vmap_of_grad_of_grad():
    in_dims = IN_DIMS[1]

    def transform(f):
        inner = torch.func.grad(loss(f))
        outer = torch.func.grad(lambda q, k, v: (inner(q, k, v) * q).sum(), argnums=(0, 1, 2))
        return torch.func.vmap(outer, in_dims=in_dims)

    compare(transform, in_dims)


def test_vmap_of_grad_of_jvp():
    in_dims = IN_DIMS[1]

    def transform(f):
        def tangent_loss(q, k, v, t_q):
            return jvp_q(f)(q, k, v, t_q).sin().sum()

        grad = torch.func.grad(tangent_loss, argnums=(0, 1, 2, 3))
        return torch.func.vmap(grad, in_dims=(*in_dims, in_dims[0]))

    compare(transform, in_dims, n_args=4)
