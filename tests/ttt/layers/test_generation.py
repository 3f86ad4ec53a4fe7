"""Generation with a `TTTTransformer` (`ttt.layers.generation`): prefill then decode gives, in float64,
the logits of one chunked read of the prompt and the tokens decoded at every position, and its greedy
tokens; sliding windows shorter and longer than a chunk, full attention, GQA, QK-norm and post-norms,
several inner steps, a masked target; without test-time training, the plain model. Then sampling,
memory that stays flat, the errors, and the graphed prefill and decoding (`ttt.layers.graphed`): the
eager logits, from static buffers (CPU) and from captured CUDA graphs (GPU)."""

import functools

import pytest
import torch

from ttt.inner import InnerLoopConfig
from ttt.layers import TTTConfig, TTTTransformer
from ttt.layers.generation import decode_step, generate, prefill, sample
from ttt.layers.graphed import GraphedDecoder, chunk_step_for
from ttt.models import Transformer, TransformerConfig

VOCAB, CHUNK = 23, 4


def make(*, window, attention="eager", steps=1, extra_mlp=True, dtype=torch.float64):
    """Three blocks, the last two read chunk by chunk with fast weights (their extra MLPs, or their own
    MLPs without extra_mlp), 4 query heads sharing 2 key/value heads, QK-norm and post-norms."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=24, window=window,
        attention=attention, qk_norm=True, post_norm=True, init_std=0.3,
    )  # fmt: skip
    base = Transformer(cfg).to(dtype)
    ttt = TTTConfig(suffix_len=2, chunk_len=CHUNK, extra_mlp=extra_mlp, extra_mlp_init="normal")
    params = ["layers.*.ttt_mlp.*"] if extra_mlp else ["layers.*.mlp.*"]
    inner = InnerLoopConfig(params=params, lr=0.7, steps=steps, grad_clip=1.0)
    return base, TTTTransformer(base, ttt, inner).to(dtype)


def prompts(length, seed=1):
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def decode_greedily(model, prompt, new, **options):
    """Prefill, then `new` greedy decode steps. Returns (prompt and tokens decoded (B, P + new), the
    logits of every position (B, P + new, V))."""
    state, logits = prefill(model, prompt, all_logits=True, **options)
    sequence, every = prompt, [logits]
    for _ in range(new):
        token = every[-1][:, -1].argmax(-1)
        sequence = torch.cat([sequence, token[:, None]], dim=1)
        every.append(decode_step(state, token)[:, None])
    return sequence, torch.cat(every, dim=1)


CASES = {
    # id: (window, attention, inner steps, prompt length)
    "window3<chunk": (3, "eager", 1, 7),
    "window9>chunk": (9, "eager", 1, 7),
    "full": (None, "eager", 1, 7),
    "full-sdpa": (None, "sdpa", 1, 6),
    "window5-2steps": (5, "eager", 2, 9),
    "prompt-of-whole-chunks": (3, "eager", 1, 8),
    "one-token-prompt": (6, "eager", 1, 1),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_prefill_and_decode_give_the_chunked_reads_logits_and_greedy_tokens(case):
    window, attention, steps, length = case
    _, model = make(window=window, attention=attention, steps=steps)
    lr_scale = 0.8
    sequence, logits = decode_greedily(model, prompts(length), 11, lr_scale=lr_scale)  # 3-4 chunk closes
    read, _ = model.read(sequence, keep_logits=True, outer_grad=False, lr_scale=lr_scale)
    torch.testing.assert_close(logits, read, rtol=0, atol=1e-10)
    assert torch.equal(read[:, length - 1 : -1].argmax(-1), sequence[:, length:])
    # the comparison can tell: without the inner steps every chunk after the first reads differently
    unadapted, _ = model.read(sequence, keep_logits=True, outer_grad=False, adapt=False)
    torch.testing.assert_close(unadapted[:, :CHUNK], read[:, :CHUNK], rtol=0, atol=1e-12)  # read at once
    assert (unadapted[:, CHUNK:] - read[:, CHUNK:]).abs().amax(-1).min() > 1e-3


def test_a_masked_target_is_left_out_of_the_inner_steps_as_in_the_chunked_read():
    _, model = make(window=5)
    prompt = prompts(10)
    prompt[:, [2, 4, 5]] = 0  # targets of chunks 0 and 1
    sequence, logits = decode_greedily(model, prompt, 7, masked_target=0)
    read, _ = model.read(sequence, keep_logits=True, outer_grad=False, loss_mask=sequence[:, 1:] != 0)
    torch.testing.assert_close(logits, read, rtol=0, atol=1e-10)
    counted, _ = model.read(sequence, keep_logits=True, outer_grad=False)
    assert (counted[:, CHUNK:] - read[:, CHUNK:]).abs().max() > 1e-3


@pytest.mark.parametrize("window", [4, None], ids=["window4", "full"])
def test_without_test_time_training_it_is_the_plain_model(window):
    base, model = make(window=window, extra_mlp=False)
    sequence, logits = decode_greedily(model, prompts(6), 9, adapt=False)
    torch.testing.assert_close(logits, base(sequence), rtol=0, atol=1e-10)
    _, adapted = decode_greedily(model, prompts(6), 9)
    assert (adapted - logits).abs().max() > 1e-3


def state_bytes(state):
    """Bytes of the storage behind the decode state's tensors (a view counts the whole of its base)."""
    tensors = [t for cache in state.prefix_caches + state.caches for t in cache]
    tensors += [state.chunk_inputs, state.chunk_tokens, *state.carry[0].values()]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_decoding_holds_the_same_memory_at_any_context_length():
    _, model = make(window=3)
    state, logits = prefill(model, prompts(6))
    logits, sizes = logits[:, -1], []
    for _ in range(4 * CHUNK):
        sizes.append(state_bytes(state))
        logits = decode_step(state, logits.argmax(-1))
        assert all(t.shape[2] <= 2 for cache in state.prefix_caches + state.caches for t in cache)
        assert not logits.requires_grad and logits.grad_fn is None
    # after the prefill's last read (at most a chunk's keys more), the same at every step
    assert len(set(sizes[1:])) == 1 and sizes[0] >= sizes[1] and state.position == 6 + 4 * CHUNK
    # the caches of a long prompt hold the window, not the prompt's keys and values
    long_prompt, short_prompt = prefill(model, prompts(6 + 40 * CHUNK))[0], prefill(model, prompts(6))[0]
    assert state_bytes(long_prompt) == state_bytes(short_prompt)


def test_generate_streams_the_greedy_tokens_and_samples_reproducibly():
    _, model = make(window=5)
    prompt = prompts(7)
    greedy = torch.stack(list(generate(model, prompt, 9)), dim=1)
    _, logits = decode_greedily(model, prompt, 8)
    assert torch.equal(greedy, logits[:, 6:].argmax(-1))
    assert torch.equal(torch.stack(list(generate(model, prompt, 9, graphs=True)), dim=1), greedy)
    drawn = [torch.stack(list(generate(model, prompt, 6, temperature=1.3, seed=s)), 1) for s in (5, 5, 6)]
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])
    nucleus = torch.stack(list(generate(model, prompt, 6, temperature=1.3, top_p=1e-9, seed=5)), 1)
    assert torch.equal(nucleus, greedy[:, :6])
    stopped = list(generate(model, prompt[:1], 9, stop_token=int(greedy[0, 2])))
    assert len(stopped) == 3


def test_sampling_keeps_to_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).expand(4000, 4))
    generator = torch.Generator().manual_seed(0)
    drawn = sample(logits, temperature=1.0, top_p=0.75, generator=generator)
    share = torch.bincount(drawn, minlength=4) / len(drawn)
    assert share[2:].sum() == 0  # 0.5 + 0.3 reach 0.75: the rest is cut
    assert abs(share[0] - 0.5 / 0.8) < 0.03
    assert torch.equal(sample(logits, temperature=0.0, top_p=0.5, generator=None), torch.zeros(4000).long())


def test_generation_runs_inside_no_grad_but_not_under_inference_mode():
    _, model = make(window=5)
    prompt = prompts(9)
    expected, _ = decode_greedily(model, prompt, 3)
    with torch.no_grad():
        assert torch.equal(decode_greedily(model, prompt, 3)[0], expected)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode.*adapt=False"):
        prefill(model, prompt)
    with torch.inference_mode():
        prefill(model, prompt, adapt=False)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_arguments_are_refused_when_generate_is_called(options, message):
    _, model = make(window=5)
    with pytest.raises(ValueError, match=message):
        generate(model, prompts(3), **{"max_new_tokens": 4, **options})


def test_a_token_of_the_wrong_shape_or_a_model_without_fast_weights_is_refused():
    base, model = make(window=5)
    state, _ = prefill(model, prompts(3))
    with pytest.raises(ValueError, match=r"token must be a \(2,\) int64 tensor"):
        decode_step(state, torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="TTTTransformer, got Transformer"):
        prefill(base, prompts(3))

GRAPHED_CASES = {
    # id: (window, prompt length, adapt)
    "window3<chunk": (3, 7, True),
    "window9>chunk": (9, 12, True),
    "prompt-shorter-than-window": (9, 3, True),
    "without-ttt": (5, 6, False),
    "prompt-of-7-chunks": (3, 30, True),  # 6 of its chunks by the graphed chunk step
}


def both_ways(model, prompt, steps, adapt, tol=1e-12, **decoder_options):
    """Greedy logits (B, steps, V) of decode_step after prefill, and of a GraphedDecoder after
    prefill(graphs=True) (whose logits must equal the eager prefill's within tol)."""
    eager_state, logits = prefill(model, prompt, adapt=adapt)
    graphed_state, graphed_logits = prefill(model, prompt, adapt=adapt, graphs=True)
    torch.testing.assert_close(graphed_logits, logits, rtol=tol, atol=tol)
    decoder = GraphedDecoder(graphed_state, **decoder_options)
    eager, graphed, token = [], [], logits[:, -1].argmax(-1)
    for _ in range(steps):
        eager.append(decode_step(eager_state, token))
        graphed.append(decoder(token))
        token = eager[-1].argmax(-1)
    assert graphed_state.position == eager_state.position
    return torch.stack(eager, 1), torch.stack(graphed, 1)


@pytest.mark.parametrize("case", GRAPHED_CASES.values(), ids=GRAPHED_CASES.keys())
def test_graphed_prefill_and_decoding_on_static_buffers_give_the_eager_logits(case):
    window, length, adapt = case
    _, model = make(window=window)
    eager, graphed = both_ways(model, prompts(length), 4 * CHUNK + 3, adapt, capture=False)  # 4 closes
    torch.testing.assert_close(graphed, eager, rtol=0, atol=1e-12)


def test_a_graphed_decoding_can_be_continued_eagerly_and_by_another_decoder():
    _, model = make(window=9)
    prompt = prompts(13)
    eager_state, logits = prefill(model, prompt)
    state, _ = prefill(model, prompt)
    token = logits[:, -1].argmax(-1)
    first, eager = GraphedDecoder(state, capture=False), functools.partial(decode_step, state)
    steps = [first, eager, first, GraphedDecoder(state, capture=False), eager, first]
    for index in range(6 * CHUNK):  # each way past a chunk close, the first decoder again after eager steps
        want = decode_step(eager_state, token)
        got = steps[index // CHUNK](token)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        token = want.argmax(-1)


def test_the_chunk_step_keeps_a_shape_per_cache_length_for_the_models_later_reads():
    _, model = make(window=9)  # caches of 0, 4 and 8 positions at a chunk's start
    _, eager = prefill(model, prompts(30))
    state, logits = prefill(model, prompts(30), graphs=True)
    step = state.chunk_step
    assert step.shapes == 3
    state, again = prefill(model, prompts(30), graphs=True)
    assert state.chunk_step is step and step.shapes == 3
    torch.testing.assert_close(again, eager, rtol=0, atol=1e-12)
    with torch.no_grad():  # a parameter moved to new memory: the shapes are built again, on its values
        model.layers[2].attn.wv.weight = torch.nn.Parameter(model.layers[2].attn.wv.weight * 1.5)
    _, eager = prefill(model, prompts(30))
    state, moved = prefill(model, prompts(30), graphs=True)
    assert step.shapes == 3
    torch.testing.assert_close(moved, eager, rtol=0, atol=1e-12)
    assert not torch.allclose(moved, again)
    assert chunk_step_for(model, state.options) is step
    assert chunk_step_for(model, state.options, capture=False) is not step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU")
@pytest.mark.filterwarnings("error:ttt.layers.graphed runs uncaptured")  # a fallback would hide the graphs
def test_the_captured_graphs_give_the_eager_logits_on_cuda():
    _, model = make(window=5, attention="flashbob", dtype=torch.float32)
    model = model.cuda()
    eager, graphed = both_ways(model, prompts(30).cuda(), 4 * CHUNK + 3, True, tol=1e-5)
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # a parameter moved to new memory: the kept graphs must not read the old one
        model.layers[2].attn.wv.weight = torch.nn.Parameter(model.layers[2].attn.wv.weight * 1.5)
    eager, graphed = both_ways(model, prompts(30).cuda(), 4 * CHUNK + 3, True, tol=1e-5)
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)


def test_full_attention_is_refused():
    _, model = make(window=None)
    state, _ = prefill(model, prompts(5))
    with pytest.raises(ValueError, match="sliding-window"):
        GraphedDecoder(state)
    with pytest.raises(ValueError, match="sliding-window"):
        generate(model, prompts(5), 3, graphs=True)  # when called, before any token
