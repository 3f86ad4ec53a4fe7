"""Neural memory (ttt.layers.neural_memory): the gated-momentum optimizer, the chunked reading against a
plain loop, causality, per-sequence memories, the outer gradient against float64 finite differences, bad
settings."""

import pytest
import torch
import torch.nn.functional as F
from reader_checks import assert_rows_read_as_if_alone, meta_loss

from ttt.experiments.gpu_memory_meters import LiveTensorMeter
from ttt.inner import InnerGatedMomentum, InnerSGD, inner_step
from ttt.layers import TTTConfig
from ttt.layers.neural_memory import (
    MemoryBlock,
    MemoryConfig,
    NeuralMemory,
    NeuralMemoryTransformer,
    memory_mlp,
)
from ttt.models import Transformer, TransformerConfig
from ttt.models.transformer import rope_cos_sin


def make(*, variant="mac", depth=2, chunk_len=4, window=3, dtype=torch.float32, **memory):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=24, window=window, attention="eager"
    )
    options = {"dim": 8, "hidden": 12, "lr_init": 0.6, "momentum_init": 0.4, "decay_init": 0.1, **memory}
    model = NeuralMemoryTransformer(
        Transformer(cfg),
        TTTConfig(suffix_len=1, extra_mlp=False, chunk_len=chunk_len),
        MemoryConfig(variant=variant, depth=depth, **options),
    )
    with torch.no_grad():  # non-zero, data-dependent everything, as after meta-training
        mem = model.suffix[0].memory
        for param in (mem.wq.weight, mem.wk.weight, mem.wv.weight, mem.wr.weight, mem.gates.weight):
            param.normal_(std=0.3)
        for weight in mem.init.values():
            weight.normal_(std=0.4)
    return model.to(dtype)


def tokens(n=15, batch=2, seed=1):
    return torch.randint(0, 32, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_gated_momentum_is_the_titans_update_with_per_row_gates():
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 2, 2)}
    grads = [{"w": torch.randn(3, 2, 2)} for _ in range(2)]
    theta, eta, alpha = (torch.rand(3, 1, 1) for _ in range(3))
    opt = InnerGatedMomentum()
    state = opt.init(params)
    w, s = params["w"], torch.zeros(3, 2, 2)
    current = params
    for g in grads:
        state = opt.with_gates(state, momentum=eta, decay={"w": alpha})
        current, state = opt.step(current, g, state, {"w": theta})
        s = eta * s - theta * g["w"]
        w = (1 - alpha) * w + s
    torch.testing.assert_close(current["w"], w)
    torch.testing.assert_close(state["surprise"]["w"], s)
    # without momentum and decay it is SGD
    sgd = InnerSGD().step(params, grads[0], {}, {"w": theta})[0]
    gated = opt.step(
        params, grads[0], opt.with_gates(opt.init(params), momentum=0.0, decay=0.0), {"w": theta}
    )
    torch.testing.assert_close(gated[0]["w"], sgd["w"])


def reference_losses(model, x, *, write=True):
    """The model's next-token losses by a plain loop (values only): one memory block, one sequence at a
    time, the memory a plain (unbatched) set of weights updated chunk by chunk by the written-out rule
    (torch.autograd.grad of the associative loss, S = eta S - theta g, W = (1 - alpha) W + S, keys and
    values detached for memory.write_grad=partial); the attention over all positions so far recomputed
    from scratch with the block's own (uncached) Attention module."""
    block, cfg = model.suffix[0], model.cfg
    mem, chunk = block.memory, model.ttt_cfg.chunk_len
    out = []
    for row in x:
        cos, sin = rope_cos_sin(len(row), cfg.head_dim, cfg.rope_theta, row.device)
        hidden = model.layers[0](model.embed(row[None]), cos, sin)[0]
        weights = {n: w.clone() for n, w in mem.init.items()}
        surprise = {n: torch.zeros_like(w) for n, w in weights.items()}
        inputs, outputs = [], []
        for start in range(0, len(row), chunk):
            x_c = hidden[start : start + chunk]
            h = block.attn_norm(x_c)
            q = F.normalize(h @ mem.wq.weight.t(), dim=-1)
            read = memory_mlp(weights, q[None])[0] @ mem.wr.weight.t()
            inputs.append(h + read if block.variant == "mac" else h)
            z = torch.cat(inputs)[None]
            a = block.attn(z, cos[: len(z[0])], sin[: len(z[0])])[0, start:]
            y = x_c + a if block.variant == "mac" else x_c + a * torch.sigmoid(read)
            outputs.append(y + block.mlp(block.mlp_norm(y)))
            if write:
                mac_from_attention = block.variant == "mac" and mem.cfg.mac_write_from == "attention"
                u = a / (a.square().mean(-1, keepdim=True) + 1e-6).sqrt() if mac_from_attention else h
                k, v = u @ mem.wk.weight.t(), u @ mem.wv.weight.t()
                if mem.cfg.next_token_values:  # token t's key stores token t + 1's value
                    k, v = k[:-1], v[1:]
                if mem.cfg.center_keys:
                    k = k - k.mean(0)
                k = F.normalize(k, dim=-1)
                if mem.cfg.write_grad == "partial":
                    k, v = k.detach(), v.detach()
                loss = 0.5 * (memory_mlp(weights, k[None])[0] - v).square().sum(-1).mean()
                grads = torch.autograd.grad(loss, list(weights.values()), retain_graph=True)
                gates = torch.sigmoid(u.mean(0) @ mem.gates.weight.t() + mem.gates.bias)
                theta, eta, alpha = mem.cfg.max_lr * gates[0], gates[1], gates[2]
                layer_input = k
                for (name, w), g in zip(list(weights.items()), grads):
                    # memory.normalize_step: this layer's lr over ||X^T X||_F / C of its inputs X (C, in)
                    rho = (layer_input.t() @ layer_input).norm() / len(k) if mem.cfg.normalize_step else 1
                    surprise[name] = eta * surprise[name] - theta / rho * g
                    weights[name] = (1 - alpha) * w + surprise[name]
                    layer_input = F.silu(layer_input @ w)
        logits = model.head(torch.cat(outputs))
        out.append(F.cross_entropy(logits[:-1], row[1:], reduction="none"))
    return torch.stack(out)


WRITE_OPTIONS = {
    "plain": {},
    "centered": {"center_keys": True},
    "normalized": {"normalize_step": True},
    "centered+normalized": {"center_keys": True, "normalize_step": True},
    "next-token values": {"next_token_values": True},
    "all": {
        "center_keys": True,
        "normalize_step": True,
        "next_token_values": True,
        "mac_write_from": "input",
        "tie_init": True,
    },
}


@pytest.mark.parametrize("variant", ["mac", "mag"])
@pytest.mark.parametrize("write_grad", ["total", "partial"])
@pytest.mark.parametrize(
    "depth, chunk_len, options",
    [(1, 1, "plain"), (2, 1, "plain"), (2, 4, "plain"), (3, 3, "plain"), (1, 4, "centered+normalized")]
    + [(2, 4, name) for name in ("centered", "normalized", "centered+normalized")]
    + [(3, 3, "centered+normalized"), (2, 4, "next-token values"), (2, 4, "all"), (1, 3, "all")],
    ids=str,
)
def test_chunked_reading_equals_a_plain_loop(variant, write_grad, depth, chunk_len, options):
    """chunk_len 1 is the per-token recurrence. float64: the recurrence amplifies rounding."""
    model = make(
        variant=variant,
        depth=depth,
        chunk_len=chunk_len,
        write_grad=write_grad,
        dtype=torch.float64,
        max_lr=0.5,  # stable without the gradient clip, which the plain loop does not have
        grad_clip=None,
        **WRITE_OPTIONS[options],
    )
    x = tokens(n=11)
    torch.testing.assert_close(model.token_losses(x), reference_losses(model, x), rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(model.token_losses(x, adapt=False), reference_losses(model, x, write=False))


@pytest.mark.parametrize("variant", ["mac", "mag"])
@pytest.mark.parametrize("chunk_len", [1, 3])
def test_full_causal_reading_equals_a_plain_loop(variant, chunk_len):
    """Without a window the blocks keep every key and value in one `PrefixCache`."""
    model = make(
        variant=variant, chunk_len=chunk_len, window=None, dtype=torch.float64, max_lr=0.5, grad_clip=None
    )
    x = tokens(n=11)
    torch.testing.assert_close(model.token_losses(x), reference_losses(model, x), rtol=1e-7, atol=1e-7)


def outer_derivatives(model, x):
    """(losses, outer gradient of their mean, and the gradient of <outer gradient, r> for a fixed random
    r: a Hessian-vector product of the outer loss), over the parameters that get a gradient."""
    losses = model.token_losses(x)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(losses.mean(), params, create_graph=True, allow_unused=True)
    used = [(p, g) for p, g in zip(params, grads) if g is not None]
    directions = torch.Generator().manual_seed(3)
    dot = sum((g * torch.randn(g.shape, generator=directions, dtype=g.dtype)).sum() for _, g in used)
    hvp = torch.autograd.grad(dot, [p for p, _ in used], allow_unused=True)
    return losses, [g for _, g in used], hvp


@pytest.mark.parametrize("variant", ["mac", "mag"])
def test_shared_prefix_and_checkpoints_give_the_losses_and_derivatives_of_concatenation(variant):
    """Full causal attention, float64, 2 sequences of 37 tokens in chunks of 5 (the last of 2): the keys and
    values in one shared buffer (`SuffixBlock.shares_prefix`), each chunk stored or checkpointed, against
    their concatenation per chunk, stored, in the losses, the outer gradient (second order through the
    writes), a Hessian-vector product of the outer loss (a gradient with a graph through the
    checkpointed chunks), and the evaluation read (detached chunks). Checkpointed chunks are recomputed
    from the same cache: the second continuation copies."""
    x = tokens(n=37)
    results = {}
    for checkpoint in (False, True):
        for shares_prefix in (True, False):
            model = make(
                variant=variant, chunk_len=5, window=None, dtype=torch.float64, checkpoint=checkpoint
            )
            model.suffix[0].shares_prefix = shares_prefix
            losses, grads, hvp = outer_derivatives(model, x)
            with torch.enable_grad():
                evaluated = model.token_losses(x, outer_grad=False)
            results[checkpoint, shares_prefix] = (losses, *grads, *hvp, evaluated)
    expected = results[False, False]
    for (checkpoint, shares_prefix), got in results.items():
        where = f"checkpoint={checkpoint}, shares_prefix={shares_prefix}"
        assert len(got) == len(expected), where
        for value, want in zip(got, expected):
            message = lambda m, w=where: f"{w}: {m}"  # noqa: E731
            torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-14, msg=message)


def one_write(memory, u):
    """The memory weights after one write of chunk u (B, C, d_model) from zero weights and surprise."""
    weights = {
        n: torch.zeros(u.shape[0], *w.shape, dtype=u.dtype, requires_grad=True)
        for n, w in memory.init.items()
    }
    return memory.write(
        weights, memory.init_state(weights), u, lr_scale=1.0, create_graph=False, retain_graph=False
    )[0]


@pytest.mark.parametrize("directions", [1, 2, 4, 8])
def test_normalized_step_writes_each_key_direction_by_theta_over_sqrt_rank(directions):
    """A linear memory (unit keys = the inputs, W_K = I), one write of a chunk whose 8 keys spread evenly
    over r orthogonal directions e_i, each with its value v_i: the mean loss's step moves M(e_i) by
    theta / r of v_i; memory.normalize_step divides the lr by rho = ||K^T K||_F / C = 1 / sqrt(r), so
    each direction gets theta / sqrt(r) (the same as without it when all keys are alike, r = 1)."""
    torch.manual_seed(0)
    memory = NeuralMemory(8, MemoryConfig(depth=1, normalize_step=True, grad_clip=None, decay_init=0.01))
    with torch.no_grad():
        memory.wk.weight.copy_(torch.eye(8))
    u = torch.eye(8)[torch.arange(8) % directions][None].double()
    memory.double()
    theta = memory.gate_values(u)[0].item()
    values = memory.wv(torch.eye(8, dtype=torch.float64)[:directions])  # v_i = e_i W_V
    written = memory_mlp(one_write(memory, u), torch.eye(8, dtype=torch.float64)[:directions][None])[0]
    torch.testing.assert_close(written, theta / directions**0.5 * values)
    memory.cfg.normalize_step = False
    plain = memory_mlp(one_write(memory, u), torch.eye(8, dtype=torch.float64)[:directions][None])[0]
    torch.testing.assert_close(plain, theta / directions * values)


def test_centered_keys_drop_the_direction_the_chunk_shares():
    """Keys that share one large direction (cosine ~0.98, as mac's attention outputs do) are, with
    memory.center_keys, the unit vectors of their deviations from the chunk's mean (near-orthogonal)."""
    torch.manual_seed(0)
    memory = NeuralMemory(16, MemoryConfig(center_keys=True))
    u = torch.randn(2, 1, 16) * 3 + 0.3 * torch.randn(2, 12, 16)
    projected = memory.wk(u)
    torch.testing.assert_close(
        memory.write_pairs(u)[0], F.normalize(projected - projected.mean(1, keepdim=True), dim=-1)
    )

    def mean_cosine(k):
        k = F.normalize(k, dim=-1)
        return ((k @ k.transpose(1, 2)).sum() - k.shape[0] * k.shape[1]) / (
            k.shape[0] * k.shape[1] * (k.shape[1] - 1)
        )

    assert mean_cosine(projected) > 0.9
    assert mean_cosine(memory.write_pairs(u)[0]).abs() < 0.2


def test_tied_initialisation_lets_a_query_read_what_was_written_for_its_own_key():
    """memory.tie_init: W_K = W_Q and W_R = W_V^T, so that (linear memory) after one write of a chunk of
    orthogonal unit inputs, reading with one of them returns its written source in the residual stream
    (theta / sqrt(r) of it, normalised step, W_V W_V^T ~ I); untied, the read is unrelated to it."""
    torch.manual_seed(0)
    options = {"depth": 1, "tie_init": True, "normalize_step": True, "grad_clip": None, "lr_init": 0.9}
    memory = NeuralMemory(64, MemoryConfig(**options))
    assert torch.equal(memory.wk.weight, memory.wq.weight)
    assert torch.equal(memory.wr.weight, memory.wv.weight.t())
    u = torch.eye(64)[None, :8] * 8  # 8 orthogonal inputs of rms 1
    readback = memory.read(one_write(memory, u), u)
    cosine = F.cosine_similarity(readback, u, dim=-1)
    assert cosine.min() > 0.5
    untied = NeuralMemory(64, MemoryConfig(**{**options, "tie_init": False}))
    assert F.cosine_similarity(untied.read(one_write(untied, u), u), u, dim=-1).abs().max() < 0.5


def test_total_write_gradient_goes_through_the_attention():
    """mac's memory reads feed the attention whose output it writes from: the total gradient of the write
    differs from the partial one (keys and values as given) from the first write on."""
    model = make(variant="mac", write_grad="total")
    x = tokens()
    total = model.token_losses(x)
    model.memory_cfg.write_grad = "partial"
    partial = model.token_losses(x)
    torch.testing.assert_close(total[:, :4], partial[:, :4], rtol=0, atol=0)  # chunk 0 reads the init
    assert (total[:, 4:] - partial[:, 4:]).abs().min() > 0


@pytest.mark.parametrize("variant", ["mac", "mag"])
@pytest.mark.parametrize("options", ["plain", "centered+normalized"])
def test_writes_are_causal_and_a_chunk_never_reads_its_own_tokens(variant, options):
    """Centred keys use the chunk's mean key, but only in the write after the chunk is read."""
    model = make(variant=variant, **WRITE_OPTIONS[options])
    x = tokens(n=15, batch=1)
    written, unwritten = model.token_losses(x), model.token_losses(x, adapt=False)
    torch.testing.assert_close(written[:, :4], unwritten[:, :4], rtol=0, atol=0)  # chunk 0 reads the init
    assert (written[:, 4:] - unwritten[:, 4:]).abs().min() > 0
    for position in (5, 7):  # inside chunk 1 (4..7) and its last token
        changed = x.clone()
        changed[0, position] = (changed[0, position] + 1) % 32
        after = model.token_losses(changed)
        # loss position p predicts token p + 1: positions < position - 1 must not move at all
        torch.testing.assert_close(after[:, : position - 1], written[:, : position - 1], rtol=0, atol=0)
        assert not torch.equal(after[:, position:], written[:, position:])


@pytest.mark.parametrize("variant", ["mac", "mag"])
def test_each_sequence_of_a_batch_has_its_own_memory(variant):
    """Rows read side by side give each row's losses and outer gradient as if read alone (float64, a
    per-row gradient clip that binds)."""
    model = make(variant=variant, grad_clip=0.05, dtype=torch.float64)
    losses_tol, grads_tol = dict(rtol=1e-9, atol=1e-10), dict(rtol=1e-7, atol=1e-9)
    assert_rows_read_as_if_alone(model, tokens(batch=3), losses_tol, grads_tol)


@pytest.mark.parametrize(
    "variant, depth, write_grad, options",
    [
        ("mac", 2, "total", "plain"),
        ("mac", 1, "partial", "plain"),
        ("mag", 2, "total", "plain"),
        ("mac", 2, "total", "centered+normalized"),
    ],
)
@pytest.mark.parametrize("along", ["every parameter", "memory.wk and memory.wv"])
def test_outer_gradient_matches_finite_differences(variant, depth, write_grad, options, along):
    """Directional derivative along the gradient (of every parameter, or of the write's key and value
    projections only, which reach the outer loss through second-order terms alone) against central
    differences in float64 (the model normalises in float32 inside RMSNorm, hence h = 1e-3)."""
    model = make(
        variant=variant, depth=depth, write_grad=write_grad, dtype=torch.float64, **WRITE_OPTIONS[options]
    )
    x = tokens(n=13, batch=1)
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(meta_loss(model, x), params)
    # first order: the write's keys and values enter only through its (constant) gradient, so W_K, W_V get
    # no outer gradient at all (W_K does with memory.normalize_step: the keys set the write's lr)
    first_order = torch.autograd.grad(meta_loss(model, x, first_order=True), params, materialize_grads=True)
    assert not first_order[names.index("layers.1.memory.wv.weight")].any()
    assert first_order[names.index("layers.1.memory.wk.weight")].any() == model.memory_cfg.normalize_step
    if along != "every parameter":
        grads = [
            g if ".memory.wk" in n or ".memory.wv" in n else torch.zeros_like(g) for n, g in zip(names, grads)
        ]
    norm = torch.sqrt(sum(g.square().sum() for g in grads))
    direction = [g / norm for g in grads]
    h, values = 1e-3, []
    for shift in (h, -2 * h, h):
        with torch.no_grad():
            for param, d in zip(params, direction):
                param.add_(shift * d)
        values.append(meta_loss(model, x, outer_grad=False))
    finite_difference = (values[0] - values[1]) / (2 * h)
    torch.testing.assert_close(norm, finite_difference, rtol=5e-3, atol=0)
    assert norm > 1e-4  # not vacuous: first order gives exactly 0 along this direction


def test_evaluation_reading_matches_training_reading_and_needs_grad_mode():
    model = make()
    x = tokens()
    with torch.no_grad(), torch.enable_grad():
        _, detached = model.read(x, outer_grad=False)
    torch.testing.assert_close(detached, model.token_losses(x).detach())
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad mode"):
        model.read(x, outer_grad=False)


def test_evaluation_reading_cuts_the_graph_between_chunks(monkeypatch):
    """outer_grad=False: every chunk gets its memory weights and write state as constants (flat memory)."""
    model, incoming = make(), []

    def spy(block, x, cos, sin, cache, weights, state, **options):
        incoming.append([*weights.values(), *state["surprise"].values()])
        return MemoryBlock.forward(block, x, cos, sin, cache, weights, state, **options)

    monkeypatch.setattr(model.suffix[0], "forward", spy.__get__(model.suffix[0]))
    model.read(tokens(), outer_grad=False)
    assert len(incoming) == 4  # 15 tokens, chunks of 4
    assert all(t.grad_fn is None for chunk in incoming for t in chunk)


def test_the_write_is_one_inner_step_of_the_engine():
    """NeuralMemory.write = ttt.inner.inner_step on the associative loss with per-row gates."""
    model = make(depth=1)
    mem = model.suffix[0].memory
    u = torch.randn(2, 4, 16)
    weights = {n: w.expand(2, *w.shape) for n, w in mem.init.items()}
    new, _ = mem.write(
        weights, mem.init_state(weights), u, lr_scale=0.5, create_graph=False, retain_graph=True
    )
    theta, eta, alpha = mem.gate_values(u, 0.5)
    row = lambda g: g.view(2, 1, 1)  # noqa: E731
    opt = InnerGatedMomentum()
    state = opt.with_gates(opt.init(weights), momentum=row(eta), decay=row(alpha))
    loss = mem.associative_loss(weights, u).sum()
    expected, _ = inner_step(
        loss,
        weights,
        state,
        optimizer=opt,
        lrs={"w0": row(theta)},
        create_graph=False,
        grad_clip=1.0,
        per_row=True,
    )
    torch.testing.assert_close(new["w0"], expected["w0"])
    assert not torch.equal(new["w0"][0], new["w0"][1])  # data-dependent, per-row gates


def test_bad_settings_name_the_key():
    for kwargs, key in [
        ({"variant": "mal"}, "memory.variant"),
        ({"depth": 0}, "memory.depth"),
        ({"dim": 0}, "memory.dim"),
        ({"lr_init": 1.0}, "memory.lr_init"),
        ({"decay_init": 0.0}, "memory.decay_init"),
        ({"write_grad": "full"}, "memory.write_grad"),
        ({"grad_clip": 0.0}, "memory.grad_clip"),
        ({"max_lr": -1.0}, "memory.max_lr"),
    ]:
        with pytest.raises(ValueError, match=key):
            MemoryConfig(**kwargs)
    base = Transformer(TransformerConfig(d_model=16, n_layers=2, n_heads=2))
    with pytest.raises(ValueError, match="ttt.extra_mlp"):
        NeuralMemoryTransformer(base, TTTConfig(), MemoryConfig())
    with pytest.raises(ValueError, match="ttt.suffix_len"):
        NeuralMemoryTransformer(base, TTTConfig(suffix_len=3, extra_mlp=False), MemoryConfig())
    with pytest.raises(ValueError, match="memory.center_keys"):
        NeuralMemoryTransformer(base, TTTConfig(extra_mlp=False, chunk_len=1), MemoryConfig(center_keys=True))
    with pytest.raises(ValueError, match="memory.next_token_values"):
        NeuralMemoryTransformer(
            base, TTTConfig(extra_mlp=False, chunk_len=1), MemoryConfig(next_token_values=True)
        )
    with pytest.raises(ValueError, match="memory.mac_write_from"):
        MemoryConfig(mac_write_from="output")


@pytest.mark.parametrize("first_order", [False, True])
def test_meta_step_for_the_gradient_memory_experiment(first_order):
    from ttt.experiments.neural_memory_workload import memory_meta_step

    cfg = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, window=4, attention="flashbob")
    model, step = memory_meta_step(
        cfg, n=20, chunk_len=8, depth=2, first_order=first_order, attention="eager"
    )
    assert model.cfg.attention == "eager" and model.suffix[0].memory.cfg.depth == 2
    loss = step()
    assert loss.isfinite() and not loss.requires_grad
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert (grads["layers.1.memory.wk.weight"] is None) == first_order  # second-order terms only
    assert grads["layers.1.memory.init.w0"].abs().sum() > 0


@pytest.mark.parametrize("variant", ["mac", "mag"])
def test_checkpointed_chunks_give_the_same_loss_and_outer_gradient(variant):
    """...and less is alive after the forward (the chunks are recomputed in the backward; byte counts,
    no noise: a no-op ties; the prefix block's activations, not recomputed, are most of both)."""
    plain, checkpointed = make(variant=variant), make(variant=variant, checkpoint=True)
    x = tokens(n=33)
    losses, kept = [], []
    for model in (plain, checkpointed):
        with LiveTensorMeter() as meter:
            losses.append(model.token_losses(x))
        kept.append(meter.live_bytes)
    assert kept[1] < kept[0]
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    grads = [
        torch.autograd.grad(loss.mean(), list(model.parameters()))
        for loss, model in zip(losses, (plain, checkpointed))
    ]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
