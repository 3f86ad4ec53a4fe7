"""`ttt.inner.recompute.recomputed`: the same values and derivatives as running the function plainly
(float64: an inner gradient inside, a module's parameters, nesting, a gradient of a gradient, of the
inputs and of the parameters, autocast), the function run twice per outer step (not three times as an
inner gradient inside torch's checkpoint makes it), non-tensor values passed through."""

import pytest
import torch
from torch import nn

from ttt.inner.recompute import recomputed

DOUBLE = torch.float64


class Chunk(nn.Module):
    """A chunk of test-time training in miniature: score x with the fast weight, one inner SGD step on
    that score (second order), return the score, the new fast weight and a pass-through."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4, dtype=DOUBLE)
        self.runs, self.autocast = 0, []

    def forward(self, state: dict, x: torch.Tensor, scale: float):
        self.runs += 1
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        fast = state["fast"]
        loss = torch.tanh(self.proj(x) @ fast).square().sum() * scale
        (grad,) = torch.autograd.grad(loss, fast, create_graph=True)
        return {"loss": loss, "fast": fast - 0.3 * grad, "tag": "chunk", "rate": state["rate"]}


def read(chunk: Chunk, x: torch.Tensor, fast0: torch.Tensor, rate: torch.Tensor, mode: str):
    """Three chunks; mode "plain", "chunks" (each recomputed) or "nested" (the chunks inside one
    recomputed span of all three). Returns the outer loss."""

    def run_chunks(state, x):
        losses = []
        for i in range(3):
            args = (state, x[i], 1.0 + i)
            out = chunk(*args) if mode == "plain" else recomputed(chunk, *args, module=chunk)
            assert out["tag"] == "chunk"
            losses.append(out["loss"])
            state = {"fast": out["fast"] * out["rate"], "rate": out["rate"]}
        return torch.stack(losses).sum(), state

    state = {"fast": fast0 * 1.0, "rate": rate * 1.0}
    if mode == "nested":
        total, state = recomputed(run_chunks, state, x, module=chunk)
    else:
        total, state = run_chunks(state, x)
    return total + state["fast"].sin().sum()


def inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 4, dtype=DOUBLE, generator=gen, requires_grad=True)
    fast0 = torch.randn(4, 4, dtype=DOUBLE, generator=gen, requires_grad=True)
    rate = torch.tensor(0.9, dtype=DOUBLE, requires_grad=True)
    return x, fast0, rate


@pytest.mark.parametrize("mode", ["chunks", "nested"])
def test_recomputed_gives_the_plain_values_and_second_order_gradients(mode):
    results = []
    for run_mode in ("plain", mode):
        chunk, (x, fast0, rate) = Chunk(), inputs()
        total = read(chunk, x, fast0, rate, run_mode)
        wrt = (x, fast0, rate, *chunk.parameters())
        results.append((total.detach(), *torch.autograd.grad(total, wrt)))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_backward_accumulates_into_parameters_as_autograd_grad_returns():
    chunk, (x, fast0, rate) = Chunk(), inputs()
    want = torch.autograd.grad(read(chunk, x, fast0, rate, "plain"), list(chunk.parameters()))
    read(chunk, x, fast0, rate, "chunks").backward()
    for param, grad in zip(chunk.parameters(), want):
        torch.testing.assert_close(param.grad, grad, rtol=1e-12, atol=1e-14)


def test_each_chunk_runs_twice_and_three_times_under_a_recomputed_span():
    for mode, runs in (("chunks", 6), ("nested", 9)):
        chunk, (x, fast0, rate) = Chunk(), inputs()
        read(chunk, x, fast0, rate, mode).backward()
        assert chunk.runs == runs


@pytest.mark.parametrize("mode", ["chunks", "nested"])
def test_a_gradient_through_recomputed_chunks_is_differentiable_again(mode):
    """A Hessian-vector product through the read: the backward's gradients, of the inputs and of the
    parameters every chunk shares, equal the plain read's and carry a graph. (Each chunk's input state
    comes from the one before, and its fast weight from its rate too: the rerun's gradient must stop
    at the chunk's own inputs and parameters, or it counts the earlier chunks' gradients twice.)"""
    results = []
    for run_mode in ("plain", mode):
        chunk, (x, fast0, rate) = Chunk(), inputs()
        wrt = (x, fast0, rate, *chunk.parameters())
        grads = torch.autograd.grad(read(chunk, x, fast0, rate, run_mode), wrt, create_graph=True)
        directions = torch.Generator().manual_seed(2)
        dot = sum((g * torch.randn(g.shape, generator=directions, dtype=DOUBLE)).sum() for g in grads)
        results.append((*(g.detach() for g in grads), *torch.autograd.grad(dot, wrt)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_gradient_with_a_graph_reruns_each_chunk_once():
    """Under create_graph too the backward reruns each recomputed chunk once: 6 runs for 3 chunks, not
    one more run of every earlier chunk per chunk."""
    chunk, (x, fast0, rate) = Chunk(), inputs()
    torch.autograd.grad(read(chunk, x, fast0, rate, "chunks"), list(chunk.parameters()), create_graph=True)
    assert chunk.runs == 6


def test_the_recomputation_runs_under_the_forwards_autocast():
    """Every run, the backward's reruns too, under the bf16 autocast of the forward: the gradients of
    the inputs equal the plain run's to the bit. (The parameters' differ in rounding: a plain read
    casts each weight to bf16 once for all chunks and sums their gradients in bf16 at that cast.)"""
    results = []
    for mode in ("plain", "chunks"):
        chunk, (x, fast0, rate) = Chunk().float(), inputs()
        x, fast0, rate = (t.detach().float().requires_grad_() for t in (x, fast0, rate))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total = read(chunk, x, fast0, rate, mode)
        results.append(torch.autograd.grad(total, (x, fast0, rate)))
        assert chunk.runs == (3 if mode == "plain" else 6) and all(chunk.autocast)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
