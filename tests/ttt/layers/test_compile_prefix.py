"""ttt.compile_prefix: the prefix blocks through torch.compile (inductor's C++ kernels on the CPU) give the
eager blocks' outputs and first derivatives in float64, compile one graph for blocks of one structure,
refuse a second derivative, and leave a second-order TTT loss and its gradients unchanged; a read without
adapting compiles its suffix blocks too."""

import pytest
import torch
from test_e2e_reference import TINY, sample_batch
from torch._dynamo.utils import counters

from recipes import load_config
from recipes.ttt_e2e import build_module
from ttt.inner import maybe_checkpoint
from ttt.layers import suffix_reader
from ttt.layers.suffix_reader import run_block_over_sequence
from ttt.models.transformer import Block, TransformerConfig, rope_cos_sin

pytestmark = pytest.mark.slow  # inductor compiles C++ kernels: about ten seconds a graph on two cores


def blocks_and_input(n_blocks=3, rows=37):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=64, d_model=48, n_layers=n_blocks, n_heads=4, n_kv_heads=2, qk_norm=True, post_norm=True,
        window=16, attention="eager",
    ).resolved()  # fmt: skip
    blocks = [Block(cfg).double() for _ in range(n_blocks)]
    x = torch.randn(2, rows, cfg.d_model, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_cos_sin(rows, cfg.head_dim, cfg.rope_theta, x.device, None, dtype=torch.float64)
    return blocks, x, cos, sin


def run_blocks(blocks, x, cos, sin, *, compiled, checkpoint=False):
    for block in blocks:
        x = maybe_checkpoint(
            lambda b, h, c, s: run_block_over_sequence(b, h, c, s, compiled=compiled), block, x, cos, sin,
            enabled=checkpoint,
        )  # fmt: skip
    return x


@pytest.mark.parametrize("checkpoint", [False, True], ids=["kept", "checkpointed"])
def test_compiled_blocks_match_eager_to_the_first_derivative_in_one_graph(checkpoint):
    blocks, x, cos, sin = blocks_and_input()
    params = [x, *(p for block in blocks for p in block.parameters())]
    torch._dynamo.reset()
    counters.clear()
    got = run_blocks(blocks, x, cos, sin, compiled=True, checkpoint=checkpoint)
    want = run_blocks(blocks, x, cos, sin, compiled=False)
    assert counters["stats"]["unique_graphs"] == 1  # the three blocks share one compiled graph
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    cotangent = torch.randn_like(want)
    for g_got, g_want in zip(
        torch.autograd.grad(got, params, cotangent), torch.autograd.grad(want, params, cotangent), strict=True
    ):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)


def test_compiled_blocks_refuse_a_second_derivative():
    """torch refuses it in one of two places: at the differentiable backward when the compiled backward
    donates buffers, else at the backward of that backward (which graph torch reuses decides which)."""
    blocks, x, cos, sin = blocks_and_input(n_blocks=1)
    out = run_blocks(blocks, x, cos, sin, compiled=True)
    with pytest.raises(RuntimeError, match="create_graph=False|does not currently support double backward"):
        (first,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        torch.autograd.grad(first.square().sum(), x)


@pytest.mark.parametrize(
    "attention", [[], ["ttt.prefix_attention=sdpa"], ["ttt.prefix_attention=sdpa_cudnn"]],
    ids=["flashbob", "sdpa", "sdpa_cudnn"],
)
def test_a_compiled_prefix_leaves_the_second_order_loss_and_gradients_unchanged(attention, monkeypatch):
    """The TTT-E2E recipe (2 suffix blocks, 1 prefix block) with ttt.compile_prefix, its blocks compiled
    on the CPU too (the reader compiles them on CUDA only), their attention FlashBoB's (here its plain
    PyTorch path) or torch's SDPA (in torch's order or cuDNN's kernel first, which the CPU lacks: the
    context that orders them traced into the graph): same loss and second-order gradients as the eager
    recipe, in float64."""
    asked = []

    def compiled_anywhere(*args, compiled):
        asked.append(compiled)
        return run_block_over_sequence(*args, compiled=True)

    batch = sample_batch()
    results = []
    for options in (TINY, [*TINY, "ttt.compile_prefix=true", *attention]):
        if options is not TINY:
            monkeypatch.setattr(suffix_reader, "run_block_over_sequence", compiled_anywhere)
        torch.manual_seed(0)
        learner = build_module(load_config(options)).double()
        params = [p for p in learner.parameters() if p.requires_grad]
        loss = sum(learner.pass_loss(rows, len(batch["tokens"]))[0] for rows in learner.split_passes(batch))
        results.append((loss, torch.autograd.grad(loss, params)))
    assert asked and not any(asked)  # CPU tokens: the reader asks for the eager blocks
    (plain, plain_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, plain, rtol=1e-12, atol=1e-12)
    for mine, reference in zip(compiled_grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-10, atol=1e-12)


def test_a_read_without_adapting_compiles_its_suffix_blocks_too(monkeypatch):
    """ttt.enabled=false: the prefix and the suffix blocks read whole sequences (`TTTTransformer._read`),
    here all compiled on the CPU: in one pass, one graph for the prefix block and one for the suffix
    blocks, and the eager read's losses and gradients in float64."""
    batch = sample_batch()
    results = []
    for compiled in (False, True):
        monkeypatch.setattr(
            suffix_reader, "run_block_over_sequence", lambda *args, compiled, force=compiled: (
                run_block_over_sequence(*args, compiled=force)
            ),
        )  # fmt: skip
        torch.manual_seed(0)
        options = [*TINY, "ttt.enabled=false", "ttt.compile_prefix=true", "ttt.sequences_per_pass=3"]
        learner = build_module(load_config(options)).double()
        params = [p for p in learner.parameters() if p.requires_grad]
        torch._dynamo.reset()
        counters.clear()
        loss = sum(learner.pass_loss(rows, len(batch["tokens"]))[0] for rows in learner.split_passes(batch))
        results.append((loss, *torch.autograd.grad(loss, params)))
        assert counters["stats"]["unique_graphs"] == (2 if compiled else 0)
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _relative_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_on_cuda_are_as_close_to_float64_as_the_eager_blocks():
    """Three blocks (FlashBoB attention, fused ops) under bf16 autocast, 1,031 positions: the compiled
    blocks' output and first derivatives are finite and at most twice the eager blocks' bf16 error
    (both against the eager blocks in float64)."""
    blocks, x, cos, sin = blocks_and_input(rows=1031)
    blocks = [block.cuda() for block in blocks]
    x, cos, sin = x.detach().cuda().requires_grad_(), cos.cuda(), sin.cuda()
    cotangent = torch.randn(x.shape, dtype=torch.float64, device="cuda")
    params = [x, *(p for block in blocks for p in block.parameters())]
    reference = run_blocks(blocks, x, cos, sin, compiled=False)  # plain PyTorch attention in float64
    reference = [reference, *torch.autograd.grad(reference, params, cotangent)]
    results = []
    for block in blocks:
        block.float().attn.backend = "flashbob"
    x32 = x.detach().float().requires_grad_()
    params = [x32, *(p for block in blocks for p in block.parameters())]
    for compiled in (True, False):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = run_blocks(blocks, x32, cos.float(), sin.float(), compiled=compiled)
        results.append([out, *torch.autograd.grad(out, params, cotangent.to(out.dtype))])
    for got, eager, want in zip(*results, reference, strict=True):
        assert torch.isfinite(got).all() and got.dtype == eager.dtype
        assert _relative_error(got, want) <= 2 * _relative_error(eager, want) + 1e-6
