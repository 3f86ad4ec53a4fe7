"""Task generators, task streams and the context chunking of the long-context learner."""

import numpy as np
import pytest
import torch

from ttt.config import OuterOptimConfig
from ttt.inner import InnerLoopConfig
from ttt.inner.meta_step import adapt_and_score
from ttt.learners import ContextChunksConfig, ContextLearner
from ttt.meta import StepAlignedSampler, SyntheticTasks, TaskDataModule, held_out_tasks
from ttt.meta.data import TEST_STREAM, TRAIN_STREAM, VAL_STREAM
from ttt.models import Transformer, TransformerConfig
from ttt.tasks import KVRecallConfig, SinusoidConfig, sample_kv_recall, sample_sinusoid


def test_kv_recall_queries_ask_for_the_values_written_in_the_context():
    cfg = KVRecallConfig(n_pairs=6, n_queries=4, n_keys=10, n_values=5, filler_len=20, n_filler_tokens=3)
    task = sample_kv_recall(cfg, np.random.default_rng(3))
    tokens, mask = task["tokens"], task["query_mask"]
    assert tokens.shape == mask.shape == (cfg.seq_len,)
    assert tokens.max() < cfg.vocab_size
    pairs = dict(zip(tokens[1:13:2].tolist(), tokens[2:13:2].tolist()))
    assert len(pairs) == 6
    positions = np.flatnonzero(mask)
    assert len(positions) == 4 and positions.min() >= cfg.context_len
    for pos in positions:
        assert pairs[int(tokens[pos])] == int(tokens[pos + 1])
    filler = tokens[13 : cfg.context_len]
    assert len(filler) == 20 and set(filler.tolist()) <= {2, 3, 4}


def test_sinusoid_tasks_follow_one_sine_per_task():
    cfg = SinusoidConfig()
    task = sample_sinusoid(cfg, np.random.default_rng(0))
    assert task["x_support"].shape == (10, 1) and task["y_query"].dtype == np.float32
    x = np.concatenate([task["x_support"], task["x_query"]])[:, 0].astype(np.float64)
    y = np.concatenate([task["y_support"], task["y_query"]])[:, 0]
    design = np.stack([np.sin(x), np.cos(x)], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    np.testing.assert_allclose(design @ coef, y, atol=1e-5)
    assert cfg.amplitude_min <= np.hypot(*coef) <= cfg.amplitude_max


def test_task_streams_are_deterministic_and_disjoint():
    cfg = SinusoidConfig()
    sample = lambda rng: sample_sinusoid(cfg, rng)  # noqa: E731
    train = SyntheticTasks(sample, seed=0, stream=TRAIN_STREAM)
    torch.testing.assert_close(train[5]["x_query"], SyntheticTasks(sample, seed=0)[5]["x_query"])
    assert not torch.equal(train[5]["x_query"], SyntheticTasks(sample, seed=1)[5]["x_query"])
    val = held_out_tasks(sample, seed=0, stream=VAL_STREAM, count=3)
    test = held_out_tasks(sample, seed=0, stream=TEST_STREAM, count=3)
    assert len(val) == 3 and isinstance(val[0]["x_query"], torch.Tensor)
    assert not torch.equal(val[0]["x_query"], test[0]["x_query"])
    assert not torch.equal(val[0]["x_query"], train[0]["x_query"])


def test_training_stream_follows_the_outer_step():
    done = [0]
    sampler = StepAlignedSampler(2, 3, lambda: done[0])
    assert list(sampler) == [0, 1, 2, 3, 4, 5] and len(sampler) == 6
    done[0] = 5
    assert list(sampler) == list(range(15, 21))


def test_context_chunks_score_every_context_position_once():
    model = Transformer(TransformerConfig(vocab_size=16, d_model=16, n_heads=2, window=4, attention="eager"))
    chunks = ContextChunksConfig(tokens_per_step=5)
    learner = ContextLearner(model, InnerLoopConfig(), OuterOptimConfig(), 1, context_len=23, chunks=chunks)
    assert learner.n_chunks == 5
    scored = []
    for chunk in range(learner.n_chunks):
        fed, start, end = learner.chunk_span(chunk)
        assert fed == max(0, start - 4)
        scored += list(range(start, end))
    assert scored == list(range(22))


def test_context_loss_weight_adds_the_context_next_token_loss_but_not_to_the_reported_query_loss():
    task_cfg = KVRecallConfig(n_pairs=3, n_queries=2, n_keys=4, n_values=4, filler_len=6, n_filler_tokens=2)
    task = {k: torch.from_numpy(v) for k, v in sample_kv_recall(task_cfg, np.random.default_rng(0)).items()}
    model = Transformer(TransformerConfig(vocab_size=16, d_model=16, n_heads=2, window=2, attention="eager"))
    losses = {}
    for weight in (0.0, 0.5):
        chunks = ContextChunksConfig(tokens_per_step=4, context_loss_weight=weight)
        learner = ContextLearner(
            model, InnerLoopConfig(), OuterOptimConfig(), 1, context_len=task_cfg.context_len, chunks=chunks
        )
        losses[weight] = learner.outer_loss(learner.initial_params(), task)
    (plain, metrics), (weighted, _) = losses[0.0], losses[0.5]
    tokens = task["tokens"]
    logits = model(tokens[None, :-1])[0]
    context = torch.nn.functional.cross_entropy(
        logits[: task_cfg.context_len - 1], tokens[1 : task_cfg.context_len]
    )
    torch.testing.assert_close(plain, metrics["query_loss"])
    torch.testing.assert_close(metrics["context_loss"], context.detach())
    torch.testing.assert_close(weighted, plain + 0.5 * context)
    batch = {k: v[None] for k, v in task.items()}
    evaluated = learner.evaluate(batch)
    torch.testing.assert_close(evaluated["query_loss_unadapted"], plain.detach())


def test_one_data_module_serves_one_sampler_or_one_per_split():
    def constant(value):
        return lambda rng: {"x": np.full(2, value, dtype=np.float32), "noise": rng.random(1)}

    sizes = dict(seed=0, meta_batch_size=3, steps_per_epoch=2, val_tasks=4, test_tasks=2, eval_batch_size=2)
    text_like = TaskDataModule({"train": constant(0), "val": constant(1), "test": constant(2)}, **sizes)
    loaders = [text_like.train_dataloader(), text_like.val_dataloader(), text_like.test_dataloader()]
    for split_value, loader in enumerate(loaders):
        batches = list(loader)
        assert {float(b["x"].unique()) for b in batches} == {split_value}
        assert [len(b["x"]) for b in batches] == [[3, 3], [2, 2], [2]][split_value]
    shared = TaskDataModule(constant(5), **sizes)
    torch.testing.assert_close(next(iter(shared.val_dataloader()))["noise"], next(iter(loaders[1]))["noise"])
    with pytest.raises(ValueError, match="one per split"):
        TaskDataModule({"train": constant(0), "test": constant(2)}, **sizes)


@pytest.mark.parametrize("first_order", [False, True])
def test_prequential_context_loss_is_the_mean_inner_loss_before_each_step_and_trains_through_it(first_order):
    torch.manual_seed(0)
    task_cfg = KVRecallConfig(n_pairs=3, n_queries=2, n_keys=4, n_values=4, filler_len=6, n_filler_tokens=2)
    task = {k: torch.from_numpy(v) for k, v in sample_kv_recall(task_cfg, np.random.default_rng(1)).items()}
    model = Transformer(
        TransformerConfig(vocab_size=16, d_model=16, n_heads=2, window=2, attention="eager")
    ).double()
    inner = InnerLoopConfig(params=["layers.0.mlp.*"], steps=3, lr=0.5, first_order=first_order)
    learners = {
        mode: ContextLearner(
            model,
            inner,
            OuterOptimConfig(),
            1,
            context_len=task_cfg.context_len,
            chunks=ContextChunksConfig(tokens_per_step=4, context_loss_weight=0.5, context_loss=mode),
        )
        for mode in ("adapted", "prequential")
    }
    preq = learners["prequential"]
    assert preq.scores_inner_losses and not learners["adapted"].scores_inner_losses
    params = preq.initial_params()
    grads = {}
    for mode, learner in learners.items():
        result = adapt_and_score(learner, learner.inner_loop, params, task)
        grads[mode] = torch.autograd.grad(result.outer_loss, list(params.values()))
        if mode == "prequential":
            expected = result.metrics["query_loss"] + 0.5 * result.inner_losses.mean()
            torch.testing.assert_close(result.outer_loss.detach(), expected)
            torch.testing.assert_close(result.metrics["prequential_loss"], result.inner_losses.mean())
    # the prequential term reaches the initial weights through the first chunk's loss and every step
    adaptation = preq.inner_loop.adapt(
        lambda p, step: preq.inner_loss(p, task, step), params, keep_loss_graphs=True
    )
    assert len(adaptation.loss_graphs) == 3 and all(loss.requires_grad for loss in adaptation.loss_graphs)
    manual = torch.autograd.grad(torch.stack(adaptation.loss_graphs).mean(), list(params.values()))
    assert any(m.abs().sum() > 0 for m in manual)
    assert any(not torch.allclose(a, b) for a, b in zip(grads["adapted"], grads["prequential"]))


def test_context_loss_choice_is_validated():
    with pytest.raises(ValueError, match="context.context_loss"):
        ContextChunksConfig(context_loss="sometimes")


def test_kv_recall_curriculum_writes_fewer_pairs_in_tasks_of_the_same_shape():
    cfg = KVRecallConfig(
        n_pairs=6, n_queries=5, n_keys=10, n_values=5, filler_len=20, n_filler_tokens=3,
        curriculum_start_pairs=2, curriculum_steps=4,
    )  # fmt: skip
    assert [cfg.pairs_at_step(s) for s in (0, 1, 2, 3, 4, 100)] == [2, 3, 4, 5, 6, 6]
    full = sample_kv_recall(cfg, np.random.default_rng(3))
    same = sample_kv_recall(cfg, np.random.default_rng(3), 6)
    np.testing.assert_array_equal(full["tokens"], same["tokens"])
    task = sample_kv_recall(cfg, np.random.default_rng(3), 2)
    tokens, mask = task["tokens"], task["query_mask"]
    assert tokens.shape == full["tokens"].shape and np.array_equal(mask, full["query_mask"])
    pairs = dict(zip(tokens[1:5:2].tolist(), tokens[2:5:2].tolist()))
    assert len(pairs) == 2 and set(tokens[5 : cfg.context_len].tolist()) <= {2, 3, 4}  # the rest is filler
    asked = [int(tokens[pos]) for pos in np.flatnonzero(mask)]
    assert len(asked) == 5 and set(asked) == set(pairs)  # the queries cycle through the two pairs
    for pos in np.flatnonzero(mask):
        assert pairs[int(tokens[pos])] == int(tokens[pos + 1])
    with pytest.raises(ValueError, match=r"n_pairs must be in \[1, task.n_pairs=6\], got 7"):
        sample_kv_recall(cfg, np.random.default_rng(0), 7)


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(curriculum_start_pairs=0, curriculum_steps=5), "task.curriculum_start_pairs must be in"),
        (dict(curriculum_start_pairs=7, curriculum_steps=5), "task.curriculum_start_pairs must be in"),
        (dict(curriculum_start_pairs=2), "task.curriculum_steps must be a positive int"),
        (dict(curriculum_steps=5), "needs task.curriculum_start_pairs"),
    ],
)
def test_kv_recall_curriculum_settings_are_checked(keys, message):
    with pytest.raises(ValueError, match=message):
        KVRecallConfig(n_pairs=6, n_queries=5, n_keys=10, **keys)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_curriculum_follows_the_outer_step_of_every_process_and_spares_the_held_out_sets(world_size):
    def plain(rng):
        return {"step": np.array(-1), "noise": rng.random(1)}

    def at_step(rng, step):
        return {"step": np.array(step), "noise": rng.random(1)}

    sizes = dict(seed=0, meta_batch_size=2, steps_per_epoch=3, val_tasks=2, test_tasks=2, eval_batch_size=2)
    data = TaskDataModule(plain, train_curriculum=at_step, **sizes)
    ranks = []
    for rank in range(world_size):
        data.trainer = type("T", (), dict(global_rank=rank, world_size=world_size, global_step=5))()
        ranks.append([batch["step"].tolist() for batch in data.train_dataloader()])
    assert all(steps == [[5, 5], [6, 6], [7, 7]] for steps in ranks), ranks
    assert next(iter(data.val_dataloader()))["step"].flatten().tolist() == [-1] * (2 // world_size)
