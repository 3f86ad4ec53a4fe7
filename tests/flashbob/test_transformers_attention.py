"""attn_implementation="bob" on tiny transformers models: logits and second-order meta-gradients
equal transformers' own "eager" attention; every mask the op cannot express is refused by name."""

import pathlib
import subprocess
import sys

import pytest
import torch
from tiny_models import ARCHS, SLIDING_ARCHS, VOCAB, cached_forward, tiny_model
from torch.func import functional_call

from flashbob import triton_ops
from flashbob.transformers_attention import (
    PaddingKeyRanges,
    UnsupportedAttentionError,
    make_attention_function,
    padding_key_ranges,
    register_transformers,
)

N = 23


def tokens(batch=2, n=N, seed=1):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_import_flashbob_does_not_import_transformers():
    code = "import sys, flashbob; assert 'transformers' not in sys.modules, 'transformers was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


ROOT = pathlib.Path(__file__).resolve().parents[2]

BESIDE_HUB_KERNELS = """
import importlib.metadata, pathlib, re, sys
import torch
needs_hub = any(re.match(r"kernels\\b", r) for r in importlib.metadata.requires("transformers") or [])
try:
    import kernels  # Hugging Face's hub-kernel loader, which current transformers requires
except ModuleNotFoundError:
    assert not needs_hub, "transformers requires Hugging Face's kernels, which is not importable"
else:
    where = pathlib.Path(kernels.__file__).resolve()
    assert where.parent != pathlib.Path(sys.argv[1]) / "kernels", f"kernels is the repository's: {where}"
    assert hasattr(kernels, "get_kernel"), f"kernels at {where} is not Hugging Face's hub-kernel loader"
import flashbob
from transformers import AutoModelForCausalLM, LlamaConfig
flashbob.register_transformers("bob")
cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=50)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="bob")
ids = torch.randint(0, 50, (1, 12))
mlp = list(model.model.layers[1].mlp.parameters())
grads = torch.autograd.grad(model(ids, labels=ids).loss, mlp, create_graph=True)
q_proj = model.model.layers[0].self_attn.q_proj.weight
meta = torch.autograd.grad(sum(g.square().sum() for g in grads), q_proj)
assert meta[0].abs().sum() > 0
print("ok", "hub kernels" if "kernels" in sys.modules else "no hub kernels")
"""


@pytest.mark.parametrize("where", ["repository root", "elsewhere"])
def test_bob_runs_beside_hugging_face_kernels(where, tmp_path):
    """The import name `flashbob` leaves `kernels` to Hugging Face's hub-kernel loader, which current
    transformers imports when it builds a model: from the repository root (where a folder of ours
    named kernels/ once shadowed it) and from another directory, a model builds and runs "bob"
    attention through a second-order step."""
    assert not (ROOT / "kernels").exists(), "a top-level kernels/ would shadow Hugging Face's package"
    cwd = ROOT if where == "repository root" else tmp_path
    done = subprocess.run([sys.executable, "-c", BESIDE_HUB_KERNELS, str(ROOT)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_eager_float32(arch):
    ids = tokens()
    want = tiny_model(arch, "eager")(ids).logits
    got = tiny_model(arch, "bob")(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_sliding_window_is_applied(arch):
    """The window changes eager's logits at N=23 > 5, and bob follows it (not plain causal)."""
    ids = tokens()
    wide = tiny_model(arch, "eager", sliding_window=64)(ids).logits
    want = tiny_model(arch, "eager")(ids).logits
    assert (wide - want).abs().max() > 1e-3
    torch.testing.assert_close(tiny_model(arch, "bob")(ids).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "gpt2"])
def test_triton_interpreter_logits_float32(arch):
    """The Triton kernels (interpreter on the CPU): sliding + full GQA layers, Gemma's scaling, GPT-2."""
    ids = tokens(batch=1, n=19)
    want = tiny_model(arch, "eager")(ids).logits
    got = tiny_model(arch, "bob_triton")(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def meta_gradients(model, ids, inner_glob_prefix="model.layers.1.mlp."):
    """One second-order MAML step: an SGD step on the first half's next-token loss over the
    parameters under inner_glob_prefix, then the second half's loss; returns d(outer)/d(every
    parameter) with the inner step differentiated through (create_graph=True)."""
    params = dict(model.named_parameters())
    if not any(k.startswith(inner_glob_prefix) for k in params):  # GPT-2 names its blocks model.h.*
        inner_glob_prefix = "transformer.h.1.mlp."
    fast_names = [k for k in params if k.startswith(inner_glob_prefix)]
    assert fast_names

    def loss(p, chunk):
        logits = functional_call(model, p, (chunk,)).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), chunk[:, 1:].reshape(-1))

    half = ids.shape[1] // 2
    inner = loss(params, ids[:, :half])
    grads = torch.autograd.grad(inner, [params[k] for k in fast_names], create_graph=True)
    adapted = dict(params)
    for name, g in zip(fast_names, grads):
        adapted[name] = params[name] - 0.5 * g
    outer = loss(adapted, ids)
    names = list(params)
    return dict(zip(names, torch.autograd.grad(outer, [params[k] for k in names], allow_unused=True)))


@pytest.fixture
def eager_softmax_in_float64(monkeypatch):
    """Eager attention computes softmax(..., dtype=float32), which rounds float64 inputs to float32;
    keep float64 inputs in float64 so that eager is a float64 reference."""
    softmax = torch.nn.functional.softmax

    def softmax_keeping_float64(x, dim=None, *args, dtype=None, **kwargs):
        if x.dtype == torch.float64 and dtype == torch.float32:
            dtype = None
        return softmax(x, dim, *args, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_keeping_float64)


@pytest.mark.parametrize("arch", ARCHS)
def test_second_order_meta_gradients_equal_eager_float64(arch, eager_softmax_in_float64):
    ids = tokens(batch=1, n=20)
    want = meta_gradients(tiny_model(arch, "eager", dtype=torch.float64), ids)
    got = meta_gradients(tiny_model(arch, "bob", dtype=torch.float64), ids)
    for name, g in want.items():
        if g is None:
            assert got[name] is None, name
            continue
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-11, msg=name)


def test_second_order_meta_gradients_triton_interpreter_float32(monkeypatch, eager_softmax_in_float64):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)
    ids = tokens(batch=1, n=12)
    want = meta_gradients(tiny_model("mistral", "eager", dtype=torch.float64), ids)
    got = meta_gradients(tiny_model("mistral", "bob_triton"), ids)
    for name, g in want.items():
        if g is not None:
            torch.testing.assert_close(got[name].double(), g, rtol=1e-3, atol=1e-5, msg=name)


def test_all_ones_attention_mask_equals_eager():
    ids = tokens()
    mask = torch.ones_like(ids)
    want = tiny_model("qwen2", "eager")(ids, attention_mask=mask).logits
    got = tiny_model("qwen2", "bob")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_decoding_with_cache_equals_eager(arch):
    """A cached two-token step: 2 queries over all keys (bottom-right aligned causal mask; Mistral's
    sliding-window cache keeps only the last keys, hence a key offset)."""
    ids = tokens(batch=1)
    results = []
    for attn in ("eager", "bob"):
        model = tiny_model(arch, attn)
        _, past = cached_forward(model, ids[:, :-2])
        results.append(cached_forward(model, ids[:, -2:], past)[0])
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def padding_mask(ids, side, pads=(3, 7)):
    """(B, N) attention mask: row b has pads[b] padding tokens on `side`, the last row none."""
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        if side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, ids.shape[1] - pad:] = 0
    return mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch, attn", [*((arch, "bob") for arch in ARCHS), ("llama", "bob_triton")])
def test_padded_batch_logits_equal_eager(arch, attn, side, monkeypatch):
    """Left or right padding runs as per-row key ranges: logits at the tokens equal eager's (Qwen2:
    one full and one sliding-window layer, w=5 < N)."""
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)
    ids = tokens(batch=3)
    mask = padding_mask(ids, side)
    want = tiny_model(arch, "eager")(ids, attention_mask=mask).logits
    got = tiny_model(arch, attn)(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    unpadded = tiny_model(arch, "eager")(ids[2:]).logits
    torch.testing.assert_close(got[2:], unpadded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_left_padded_decoding_with_cache_equals_eager(arch):
    """Generation-style: a left-padded prefill, then a cached two-token step with the mask extended
    (Mistral's sliding-window cache cuts the mask at a key offset)."""
    ids = tokens(batch=3)
    mask = padding_mask(ids, "left")
    results = []
    for attn in ("eager", "bob"):
        model = tiny_model(arch, attn)
        _, past = cached_forward(model, ids[:, :-2], attention_mask=mask[:, :-2])
        results.append(cached_forward(model, ids[:, -2:], past, attention_mask=mask)[0])
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def padded_meta_gradients(model, ids, mask):
    """`meta_gradients` on a padded batch: the next-token losses count only pairs of real tokens."""
    params = dict(model.named_parameters())
    fast_names = [k for k in params if k.startswith("model.layers.1.mlp.")]

    def loss(p, chunk, chunk_mask):
        logits = functional_call(model, p, (chunk,), {"attention_mask": chunk_mask}).logits
        pairs = (chunk_mask[:, :-1] * chunk_mask[:, 1:]).bool()
        return torch.nn.functional.cross_entropy(logits[:, :-1][pairs], chunk[:, 1:][pairs])

    half = ids.shape[1] // 2
    inner = loss(params, ids[:, :half], mask[:, :half])
    grads = torch.autograd.grad(inner, [params[k] for k in fast_names], create_graph=True)
    adapted = {**params, **{k: params[k] - 0.5 * g for k, g in zip(fast_names, grads)}}
    outer = loss(adapted, ids, mask)
    return dict(zip(params, torch.autograd.grad(outer, list(params.values()), allow_unused=True)))


def test_second_order_meta_gradients_left_padded_equal_eager_float64(eager_softmax_in_float64):
    ids = tokens(batch=3, n=20)
    mask = padding_mask(ids, "left", pads=(3, 8))
    want = padded_meta_gradients(tiny_model("qwen2", "eager", dtype=torch.float64), ids, mask)
    got = padded_meta_gradients(tiny_model("qwen2", "bob", dtype=torch.float64), ids, mask)
    for name, g in want.items():
        if g is None:
            assert got[name] is None, name
            continue
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-11, msg=name)


def test_padding_key_ranges_of_each_row():
    rows = [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]  # left, right, both, none
    keys = torch.tensor(rows, dtype=torch.bool)
    ranges = padding_key_ranges("bob", keys)
    assert ranges.key_start.tolist() == [2, 0, 1, 0] and ranges.key_end.tolist() == [5, 3, 3, 0]
    assert ranges.kv_length == 5
    assert padding_key_ranges("bob", torch.ones(2, 5, dtype=torch.bool)) is None
    with pytest.raises(UnsupportedAttentionError, match=r"batch row\(s\) \[0, 2\] has holes"):
        padding_key_ranges("bob", torch.tensor([[1, 0, 1], [0, 1, 1], [1, 0, 1]], dtype=torch.bool))


def test_key_ranges_for_other_keys_are_refused():
    attention = make_attention_function("bob", "torch")
    q, k = torch.randn(2, 2, 5, 8), torch.randn(2, 1, 6, 8)
    ranges = PaddingKeyRanges(torch.tensor([0, 1]), torch.tensor([5, 5]), kv_length=5)
    with pytest.raises(UnsupportedAttentionError, match="built for 2 rows of 5 keys, the layer has 2 of 6"):
        attention(torch.nn.Module(), q, k, k, ranges)


def test_padding_mask_with_holes_is_refused():
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, 5] = 0
    message = r"batch row\(s\) \[1\] has holes.*one contiguous range"
    with pytest.raises(UnsupportedAttentionError, match=message):
        tiny_model("llama", "bob")(ids, attention_mask=mask)


def test_packed_sequences_are_refused():
    """position_ids that restart mark packed sequences (transformers looks only without a cache): a
    block-diagonal mask the op cannot express."""
    ids = tokens(batch=1, n=12)
    position_ids = torch.cat([torch.arange(6), torch.arange(6)])[None]
    with pytest.raises(UnsupportedAttentionError, match="packed sequences"):
        tiny_model("llama", "bob")(ids, position_ids=position_ids, use_cache=False)


def test_prepared_4d_mask_is_refused():
    ids = tokens(batch=1, n=8)
    mask = torch.zeros(1, 1, 8, 8)
    with pytest.raises(UnsupportedAttentionError, match="prepared attention mask"):
        tiny_model("llama", "bob")(ids, attention_mask=mask)


def test_attention_dropout_in_training_is_refused():
    model = tiny_model("llama", "bob", attention_dropout=0.1).train()
    with pytest.raises(UnsupportedAttentionError, match="attention dropout"):
        model(tokens())


def test_gemma2_logit_softcapping_is_refused():
    model = tiny_model("gemma2", "bob", attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedAttentionError, match="soft-capping"):
        model(tokens())


def test_bidirectional_attention_is_refused():
    model = tiny_model("gemma3", "bob", use_bidirectional_attention=True)
    with pytest.raises(UnsupportedAttentionError, match="bidirectional"):
        model(tokens())


@pytest.mark.parametrize("name", ["flash_bob", "eager", "sdpa", ""])
def test_register_refuses_reserved_names(name):
    with pytest.raises(ValueError, match="name must be"):
        register_transformers(name)


def test_register_refuses_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        register_transformers("bob_x", backend="cuda")


def test_static_cache_slots_are_refused():
    """A StaticCache hands over all max_cache_len key slots, the unfilled ones masked: not expressible."""
    from transformers import StaticCache

    model = tiny_model("llama", "bob")
    cache = StaticCache(config=model.config, max_cache_len=32)
    with pytest.raises(UnsupportedAttentionError, match="kv_length=32"):
        cached_forward(model, tokens(batch=1, n=10), cache)
