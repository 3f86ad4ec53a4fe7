"""recipe=ttt_e2e_125m against a literal float64 transcription of TTT-E2E's official algorithm
(test-time-training/e2e, restated from its code, not copied): one loop over chunks, an explicit
sliding-window cache of normed, unrotated keys and raw values, interleaved-pair RoPE on the official
weight layout, QK-norm, pre- and post-norms, the prime MLPs as the only fast weights, the BOS-masked
chunk mean as the inner loss, optax's clip rule, SGD at the warm-up's inner lr, and the mean over
chunks of the masked chunk means as the loss. No chunk reader, no recomputation, no fused ops.

The production path is the recipe's own learner at a tiny size in float64, every option of the recipe
on (fused ops and loss, chunk and prefix recomputation, sequences split into passes, tied head): its
loss and its second-order gradient for every parameter equal the reference's to 1e-10."""

import math

import pytest
import torch
import torch.nn.functional as F

from recipes import load_config
from recipes.ttt_e2e import build_module
from ttt.layers import PrefixCache

TINY = [
    "recipe=ttt_e2e_125m",
    "model.vocab_size=260",  # bytes (256) and the stream's BOS, 256
    "model.d_model=16",
    "model.n_layers=3",
    "model.n_heads=2",
    "model.d_ff=12",
    "model.window=6",
    "model.init_std=0.4",  # large enough that some inner gradients are clipped
    "model.attention=eager",
    "ttt.suffix_len=2",
    "ttt.chunk_len=4",
    "ttt.sequences_per_pass=2",
    "data.seq_len=12",
]
BOS, CHUNK, WINDOW, EPS = 256, 4, 6, 1e-6


def rms(u, gain):
    return gain * u / torch.sqrt(u.square().mean(-1, keepdim=True) + EPS)


def swiglu(u, w1, w3, w2):
    return (F.silu(u @ w1) * (u @ w3)) @ w2


def rope_interleaved(u, positions, theta):
    """u (T, H, Dh) rotated pair by pair: dims (2k, 2k+1) by the angle p / theta^(2k / Dh)."""
    dim = u.shape[-1]
    omega = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = positions.to(torch.float64)[:, None, None] * omega
    a, b = u[..., 0::2], u[..., 1::2]
    return torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1).flatten(-2)


def official_weights(model, head_dim):
    """The model's parameters in the official layout ((in, out) kernels; q, k columns and QK-norm gains
    in interleaved-pair order), as differentiable functions of our parameters."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    back = torch.argsort(order)  # official dim P[j] holds our dim j

    def qk(weight):  # ours (heads * Dh, d) -> official (d, heads * Dh) in interleaved order
        heads = weight.shape[0] // head_dim
        return weight.view(heads, head_dim, -1)[:, back].reshape(weight.shape).t()

    blocks = []
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        mlp = layer.mlp
        block = {
            "seq_norm": layer.attn_norm.weight, "seq_post_norm": layer.attn_post_norm.weight,
            "wq": qk(attn.wq.weight), "wk": qk(attn.wk.weight), "wv": attn.wv.weight.t(),
            "wo": attn.wo.weight.t(), "q_norm": attn.q_norm.weight[back], "k_norm": attn.k_norm.weight[back],
            "ffn_norm": layer.mlp_norm.weight, "ffn_post_norm": layer.mlp_post_norm.weight,
            "w1": mlp.w_gate.weight.t(), "w3": mlp.w_up.weight.t(), "w2": mlp.w_down.weight.t(),
        }  # fmt: skip
        if i >= model.first_suffix:
            block["prime_norm"], block["prime_post_norm"] = layer.ttt_norm.weight, layer.ttt_post_norm.weight
            block["phi"] = [layer.ttt_mlp.w_gate.weight.t(), layer.ttt_mlp.w_up.weight.t(),
                            layer.ttt_mlp.w_down.weight.t()]  # fmt: skip
        blocks.append(block)
    return blocks


def project_heads(x, block, heads, positions, theta):
    """q (T, H, Dh) rotated, k (T, H, Dh) normed but not rotated, v (T, H, Dh)."""
    t = x.shape[0]
    q = rms((x @ block["wq"]).view(t, heads, -1), block["q_norm"])
    k = rms((x @ block["wk"]).view(t, heads, -1), block["k_norm"])
    return rope_interleaved(q, positions, theta), k, (x @ block["wv"]).view(t, heads, -1)


def attend(q, k_rot, v, query_index, key_index, window):
    """Softmax attention of q (T, H, Dh) over keys at absolute key_index: allowed where 0 <= key <= query
    and query - key < window (the official mask, zero cache slots have negative indices)."""
    scores = torch.einsum("thd,shd->hts", q, k_rot) / math.sqrt(q.shape[-1])
    gap = query_index[:, None] - key_index[None, :]
    allowed = (key_index[None, :] >= 0) & (gap >= 0) & (gap < window)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", weights, v).flatten(1)


def block_tail(x, attended, block, phi):
    """Post-normed residuals of attention, the prime MLP (suffix blocks: phi) and the MLP."""
    x = x + rms(attended @ block["wo"], block["seq_post_norm"])
    if phi is not None:
        x = x + rms(swiglu(rms(x, block["prime_norm"]), *phi), block["prime_post_norm"])
    return x + rms(
        swiglu(rms(x, block["ffn_norm"]), block["w1"], block["w3"], block["w2"]), block["ffn_post_norm"]
    )


def suffix_chunk(h, rows, phi, caches, suffix, model, targets, mask, theta, heads, window):
    """The suffix blocks on chunk `rows` of the prefix output h with prime weights phi and each block's
    cache (the last `window` keys and values before the chunk): the chunk's masked mean loss, new caches."""
    z, new_caches = h[rows], []
    chunk_positions = torch.arange(window, window + CHUNK)  # relative to the window, as the official code
    window_positions = torch.arange(window + CHUNK)
    for block, weights, (k_cache, v_cache) in zip(suffix, phi, caches):
        q, k, v = project_heads(rms(z, block["seq_norm"]), block, heads, chunk_positions, theta)
        k_all, v_all = torch.cat([k_cache, k]), torch.cat([v_cache, v])
        key_index = rows[0] - window + window_positions
        attended = attend(q, rope_interleaved(k_all, window_positions, theta), v_all, rows, key_index, window)
        z = block_tail(z, attended, block, weights)
        new_caches.append((k_all[-window:], v_all[-window:]))
    logits = rms(z, model.norm.weight) @ model.embed.weight.t()
    nll = torch.logsumexp(logits, -1) - logits.gather(1, targets[rows, None])[:, 0]
    m = mask[rows]
    return (nll * m).sum() / torch.clamp(m.sum(), min=1e-10), new_caches


def reference_loss(model, tokens, eta, theta, heads, clipped, window=WINDOW):
    """The official meta-loss of one sequence tokens (L + 1,): prefix once, then chunk by chunk."""
    blocks = official_weights(model, model.cfg.head_dim)
    inputs, targets = tokens[:-1], tokens[1:]
    mask = (targets != BOS).to(torch.float64)
    positions = torch.arange(len(inputs))
    h = model.embed.weight[inputs]
    for block in blocks[: model.first_suffix]:
        q, k, v = project_heads(rms(h, block["seq_norm"]), block, heads, positions, theta)
        attended = attend(q, rope_interleaved(k, positions, theta), v, positions, positions, window)
        h = block_tail(h, attended, block, None)
    suffix = blocks[model.first_suffix :]
    phi = [list(block["phi"]) for block in suffix]
    zeros = torch.zeros(window, heads, h.shape[1] // heads, dtype=torch.float64)
    caches = [(zeros, zeros) for _ in suffix]
    chunk_losses = []
    for c in range(len(inputs) // CHUNK):
        rows = torch.arange(c * CHUNK, (c + 1) * CHUNK)
        loss_c, new_caches = suffix_chunk(
            h, rows, phi, caches, suffix, model, targets, mask, theta, heads, window
        )
        flat = [w for weights in phi for w in weights]
        grads = torch.autograd.grad(loss_c, flat, create_graph=True)
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        clipped.append(bool(norm >= 1.0))
        if norm >= 1.0:
            grads = [g / norm for g in grads]
        stepped = [w - eta * g for w, g in zip(flat, grads)]
        phi = [stepped[3 * b : 3 * b + 3] for b in range(len(suffix))]
        caches = new_caches
        chunk_losses.append(loss_c)
    return torch.stack(chunk_losses).mean()


def sample_batch(vocab=256):
    """Three 13-token slices of a BOS-joined stream; the second has a chunk whose targets are all BOS."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (3, 13), generator=generator)
    tokens[0, 0], tokens[0, 6], tokens[2, 3], tokens[2, 11] = BOS, BOS, BOS, BOS
    tokens[1, 5:9] = BOS  # targets 4..7: the whole second chunk is masked
    return {"tokens": tokens, "loss_mask": tokens[:, 1:] != BOS}


def build_learner(*overrides):
    torch.manual_seed(0)
    learner = build_module(load_config([*TINY, *overrides])).double()
    assert learner.model.inner_cfg.checkpoint  # the recipe recomputes each chunk (and keeps the prefix)
    return learner


@pytest.fixture(scope="module")
def learner():
    return build_learner()


@pytest.mark.slow
@pytest.mark.parametrize("window", [WINDOW, 12], ids=["window-6", "window-12-covers"])
def test_the_recipe_equals_the_literal_official_algorithm_to_1e_10(window, learner):
    """Window 6: the suffix's keys and values are concatenated per chunk, cut to the window. Window 12,
    which covers the 13-position read but for its last query (as 8,192 does TTT-E2E's 8,193-token
    slices): they are written into one shared buffer (`PrefixCache`), replayed in place when a chunk is
    recomputed."""
    if window != WINDOW:
        learner = build_learner(f"model.window={window}")
    model, cfg = learner.model, learner.model.cfg
    assert isinstance(model.suffix[0].initial_cache(13, CHUNK), PrefixCache) == (window != WINDOW)
    batch = sample_batch()
    params = [p for p in learner.parameters() if p.requires_grad]
    passes = learner.split_passes(batch)
    assert [len(rows["tokens"]) for rows in passes] == [2, 1]
    ours = sum(learner.pass_loss(rows, len(batch["tokens"]))[0] for rows in passes)
    our_grads = torch.autograd.grad(ours, params)

    eta = model.ttt_cfg.lr_scale(learner.global_step) * model.inner_cfg.lr
    assert eta == pytest.approx(0.101875)  # 0.1 + 0.9 * (0 + 1) / 480 at the first outer step
    clipped = []
    theirs = torch.stack(
        [
            reference_loss(model, row, eta, cfg.rope_theta, cfg.n_heads, clipped, window)
            for row in batch["tokens"]
        ]
    ).mean()
    their_grads = torch.autograd.grad(theirs, params)
    assert True in clipped and False in clipped  # both branches of the clip rule are exercised

    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    names = [name for name, p in learner.named_parameters() if p.requires_grad]
    for name, mine, reference in zip(names, our_grads, their_grads):
        torch.testing.assert_close(mine, reference, rtol=1e-10, atol=1e-10, msg=name)
    assert any("ttt_mlp" in name for name in names) and any("q_norm" in name for name in names)


@pytest.mark.slow
def test_the_reference_sees_second_order_terms_a_first_order_reading_lacks(learner):
    """The comparison above would catch a missing create_graph: the first-order gradient differs."""
    batch = sample_batch()
    params = [p for p in learner.parameters() if p.requires_grad]
    model = learner.model
    first = model.token_losses(
        batch["tokens"], lr_scale=0.101875, loss_mask=batch["loss_mask"], first_order=True
    )
    second = model.token_losses(batch["tokens"], lr_scale=0.101875, loss_mask=batch["loss_mask"])
    g_first = torch.autograd.grad(learner.objective(first, batch["loss_mask"]).mean(), params)
    g_second = torch.autograd.grad(learner.objective(second, batch["loss_mask"]).mean(), params)
    assert max((a - b).abs().max().item() for a, b in zip(g_first, g_second)) > 1e-6


@pytest.mark.slow
def test_without_ttt_the_recipe_equals_the_literal_algorithm_with_no_inner_step():
    """ttt.enabled=false (the baseline of the short runs in docs/scale.md) is the same model read with
    its initial fast weights: the reference at inner lr 0, loss and every gradient to 1e-10."""
    torch.manual_seed(0)
    learner = build_module(load_config([*TINY, "ttt.enabled=false"])).double()
    model, cfg = learner.model, learner.model.cfg
    batch = sample_batch()
    params = [p for p in learner.parameters() if p.requires_grad]
    ours = sum(learner.pass_loss(rows, len(batch["tokens"]))[0] for rows in learner.split_passes(batch))
    our_grads = torch.autograd.grad(ours, params, allow_unused=True)
    theirs = torch.stack(
        [reference_loss(model, row, 0.0, cfg.rope_theta, cfg.n_heads, []) for row in batch["tokens"]]
    ).mean()
    their_grads = torch.autograd.grad(theirs, params, allow_unused=True)

    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    names = [name for name, p in learner.named_parameters() if p.requires_grad]
    for name, mine, reference in zip(names, our_grads, their_grads):
        assert (mine is None) == (reference is None), name
        if mine is not None:
            torch.testing.assert_close(mine, reference, rtol=1e-10, atol=1e-10, msg=name)
    assert all(g is not None for name, g in zip(names, our_grads) if "ttt_mlp" in name)


@pytest.mark.slow
@pytest.mark.parametrize("window", [12, 5])
def test_the_prefix_needs_first_derivatives_only_so_sdpa_may_run_it(window):
    """ttt.prefix_attention=sdpa: the prefix blocks run torch's fused CPU kernel, whose backward has no
    derivative of its own, and the second-order loss and gradient are those of the recipe as it is. A
    window as long as the sequence lets SDPA take the fused kernel (no explicit mask); a shorter one
    runs the windowed query blocks."""
    whole = [*TINY, f"model.window={window}"]
    q = torch.randn(1, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.autograd.grad(g.sum(), q)  # the fused kernel: no double backward

    batch = sample_batch()
    results = []
    for options in (whole, [*whole, "ttt.prefix_attention=sdpa"]):
        torch.manual_seed(0)
        learner = build_module(load_config(options)).double()
        params = [p for p in learner.parameters() if p.requires_grad]
        loss = sum(learner.pass_loss(rows, len(batch["tokens"]))[0] for rows in learner.split_passes(batch))
        results.append((loss, torch.autograd.grad(loss, params)))
    (plain, plain_grads), (fused, fused_grads) = results
    prefix = learner.model.layers[: learner.model.first_suffix]
    assert [block.attn.backend for block in prefix] == ["sdpa"]
    assert learner.model.suffix[0].cfg.attention == "eager"
    torch.testing.assert_close(fused, plain, rtol=1e-10, atol=1e-10)
    for mine, reference in zip(fused_grads, plain_grads):
        torch.testing.assert_close(mine, reference, rtol=1e-10, atol=1e-10)
