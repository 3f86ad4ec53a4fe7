"""MetaLearner used directly (a user subclass, evaluation, schedules) and the run-tracking helpers."""

import dataclasses
import json

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from ttt.config import OuterOptimConfig
from ttt.inner import InnerLoopConfig
from ttt.meta import MetaLearner
from ttt.meta.outer import lr_multiplier
from ttt.tracking import AtomicCheckpointIO, atomic_write_text, format_summary_table, write_summary
from ttt.tracking.report import new_figure, save_figure


class ShiftLearner(MetaLearner):
    """Tasks: regress y = x + shift; the inner loop fits the bias on the support set."""

    def inner_loss(self, params, task, step):
        return (self.forward_with(params, task["x"]) - task["y"]).square().mean()

    def outer_loss(self, params, task):
        error = (self.forward_with(params, task["xq"]) - task["yq"]).square().mean()
        return error, {"error": error.detach()}


def _shift_batch(n_tasks=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shift = 3 * torch.randn(n_tasks, 1, 1, generator=gen)
    x, xq = torch.randn(n_tasks, 8, 1, generator=gen), torch.randn(n_tasks, 8, 1, generator=gen)
    return {"x": x, "y": x + shift, "xq": xq, "yq": xq + shift}


def test_user_subclass_meta_trains_with_lightning_and_adapts_at_evaluation():
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    inner = InnerLoopConfig(params=["bias"], steps=3, lr=0.3)
    learner = ShiftLearner(model, inner, OuterOptimConfig(lr=0.05, scheduler="constant"), total_steps=40)
    trainer = _fit(learner, max_steps=40)
    assert learner.model.weight.item() == pytest.approx(1.0, abs=0.1)
    metrics = trainer.validate(
        learner, torch.utils.data.DataLoader([_shift_batch(seed=99)], batch_size=None)
    )[0]
    assert metrics["val/query_loss_adapted"] < 0.2 * metrics["val/query_loss_unadapted"]
    assert metrics["val/error_adapted"] == pytest.approx(metrics["val/query_loss_adapted"])


def test_evaluation_under_inference_mode_is_refused_with_the_fix():
    learner = ShiftLearner(nn.Linear(1, 1), InnerLoopConfig(params=["bias"]), OuterOptimConfig(), 1)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode=False"):
        learner.evaluate(_shift_batch())


def test_meta_learned_inner_lrs_are_optimized():
    inner = InnerLoopConfig(params=["bias"], learnable_lr="tensor", lr=0.1)
    learner = ShiftLearner(nn.Linear(1, 1), inner, OuterOptimConfig(), 1)
    optimizer = learner.configure_optimizers()["optimizer"]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(learner.inner_loop.lrs[0]) in optimized
    assert len(optimizer.param_groups) == 1


def test_lr_outer_lr_puts_the_inner_lrs_in_their_own_scheduled_group():
    inner = InnerLoopConfig(params=["bias"], learnable_lr="tensor", lr_space="log", lr_outer_lr=0.05, lr=0.1)
    learner = ShiftLearner(nn.Linear(1, 1), inner, OuterOptimConfig(lr=1e-3, warmup_steps=2), 10)
    built = learner.configure_optimizers()
    rest, lrs = built["optimizer"].param_groups
    assert [id(p) for p in lrs["params"]] == [id(learner.inner_loop.log_lrs[0])]
    assert {id(p) for p in rest["params"]} == {id(p) for p in learner.model.parameters()}
    assert (rest["initial_lr"], lrs["initial_lr"]) == (1e-3, 0.05)
    assert lrs["lr"] == pytest.approx(0.05 / 2)  # warm-up step 0 of 2 scales both groups
    assert learner.step_metrics()["inner_lr"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "scheduler, expected",
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.7, 0.4]),
        ("cosine", [0.5, 1.0, 1.0, 0.775, 0.325]),
    ],
)
def test_lr_schedules(scheduler, expected):
    cfg = OuterOptimConfig(scheduler=scheduler, warmup_steps=2, min_lr_ratio=0.1)
    got = [lr_multiplier(step, cfg=cfg, total_steps=5) for step in range(5)]
    assert got == pytest.approx(expected)


def test_warm_up_from_zero_is_optax_linear_warm_up_then_cosine_to_the_floor():
    """TTT-E2E's outer schedule: lr 0 at the first step, s / warmup after, cosine to min_lr_ratio."""
    cfg = OuterOptimConfig(warmup_steps=480, warmup_from_zero=True, min_lr_ratio=1e-5 / 3e-3)
    lr = [3e-3 * lr_multiplier(s, cfg=cfg, total_steps=4800) for s in (0, 1, 479, 480, 2640, 4799, 6000)]
    assert lr == pytest.approx([0.0, 6.25e-6, 2.99375e-3, 3e-3, 1.505e-3, 1.0000395e-5, 1e-5], rel=1e-6)


@pytest.mark.parametrize("scheduler", ["cosine", "linear"])
def test_lr_schedules_never_jump_past_their_end_or_a_warm_up_that_fills_them(scheduler):
    """Past the schedule's end the factor stays at its final value; a warm-up as long as the schedule (or
    longer) leaves no decay, so the factor stays at 1 after it instead of dropping to min_lr_ratio."""
    cfg = OuterOptimConfig(scheduler=scheduler, warmup_steps=4, min_lr_ratio=0.1)
    for total in (3, 4):
        got = [lr_multiplier(step, cfg=cfg, total_steps=total) for step in range(9)]
        assert got == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 1])
    after_the_end = [lr_multiplier(step, cfg=cfg, total_steps=6) for step in range(6, 10)]
    assert after_the_end == pytest.approx([0.1] * 4)


def _fit(learner, max_steps=4, **trainer_options):
    trainer = pl.Trainer(
        max_steps=max_steps,
        inference_mode=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **trainer_options,
    )
    batches = [_shift_batch(seed=i) for i in range(max_steps)]
    trainer.fit(learner, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return trainer


@pytest.mark.parametrize(
    "option, instead",
    [({"gradient_clip_val": 1.0}, r"OuterOptimConfig\(grad_clip=1.0\) \(optim.grad_clip"),
     ({"accumulate_grad_batches": 2}, r"a larger batch \(trainer.meta_batch_size\)")],
    ids=["gradient_clip_val", "accumulate_grad_batches"],
)  # fmt: skip
def test_trainer_options_of_automatic_optimization_name_what_to_use_instead(option, instead):
    learner = ShiftLearner(nn.Linear(1, 1), InnerLoopConfig(params=["bias"]), OuterOptimConfig(), 4)
    flag = next(iter(option))
    with pytest.raises(ValueError, match=f"{flag}=.* does not apply to ShiftLearner.*{instead}"):
        _fit(learner, **option)


def test_the_run_length_must_be_the_trainers_max_steps_and_may_come_from_it():
    inner, cosine = InnerLoopConfig(params=["bias"]), OuterOptimConfig(scheduler="cosine", min_lr_ratio=0.1)
    with pytest.raises(ValueError, match=r"total_steps=40\) but the Trainer's max_steps is 4"):
        _fit(ShiftLearner(nn.Linear(1, 1), inner, cosine, total_steps=40))
    learner = ShiftLearner(nn.Linear(1, 1), inner, cosine)  # the schedule spans the Trainer's 4 steps
    _fit(learner)
    assert learner.lr_schedulers().get_last_lr() == pytest.approx([0.1 * cosine.lr])
    two_steps = dataclasses.replace(cosine, schedule_steps=2)
    shorter = ShiftLearner(nn.Linear(1, 1), inner, two_steps, total_steps=4)
    _fit(shorter)  # a schedule of its own length: 2 steps, then its final lr
    assert shorter.lr_schedulers().get_last_lr() == pytest.approx([0.1 * cosine.lr])


def test_atomic_checkpoint_keeps_the_old_file_when_a_save_fails(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)

    def failing_save(obj, handle):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_a_figure_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "curves.png"
    fig, (ax,) = new_figure()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, path)
    before = path.read_bytes()
    assert before.startswith(b"\x89PNG")
    fig, (ax,) = new_figure()
    ax.plot([0, 1], [float("nan"), 0])

    def failing_savefig(handle, **kwargs):
        handle.write(b"partial")
        raise OSError("disk full")

    fig.savefig = failing_savefig
    with pytest.raises(OSError, match="disk full"):
        save_figure(fig, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["curves.png"]


def test_summary_file_and_table(tmp_path):
    summary = {
        "query_loss_unadapted": 4.2,
        "query_loss_adapted": 0.01,
        "outer_steps": 3,
        "peak_memory_gib": None,
    }
    write_summary(tmp_path / "summary.json", summary)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    table = format_summary_table(summary)
    assert table.splitlines()[0].split() == ["metric", "unadapted", "adapted"]
    assert table.splitlines()[2].split() == ["query_loss", "4.2000", "0.0100"]
    assert "peak_memory_gib  -" in table
    atomic_write_text(tmp_path / "note.txt", "hello")
    assert (tmp_path / "note.txt").read_text() == "hello"
    assert (tmp_path / "note.txt").stat().st_mode & 0o777 == 0o644


def test_peak_memory_is_read_at_train_end(monkeypatch):
    """Lightning moves the module back to the CPU after fit: the timer must read the peak before."""
    import types

    from ttt.tracking.timing import OuterStepTimer

    timer = OuterStepTimer()
    timer.on_train_end(None, types.SimpleNamespace(device=torch.device("cpu")))
    assert timer.peak_memory_gib is None
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    timer.on_train_end(None, types.SimpleNamespace(device=torch.device("cuda")))
    assert timer.peak_memory_gib == 3.0


def test_allocator_retries_are_counted_per_cuda_step(monkeypatch):
    """Each CUDA outer step records the allocator's retries during it; CPU steps record none."""
    import types

    from ttt.tracking.timing import OuterStepTimer

    timer, cpu = OuterStepTimer(), types.SimpleNamespace(device=torch.device("cpu"), log=lambda *a, **k: None)
    timer.on_train_batch_start(None, cpu, None, 0)
    timer.on_train_batch_end(None, cpu, None, None, 0)
    assert timer.alloc_retries == [] and len(timer.durations) == 1
    counts = iter([4, 9, 9, 9])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": next(counts)})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    gpu = types.SimpleNamespace(device=torch.device("cuda"), log=lambda *a, **k: None)
    for step in range(2):
        timer.on_train_batch_start(None, gpu, None, step)
        timer.on_train_batch_end(None, gpu, None, None, step)
    assert timer.alloc_retries == [5, 0]


class _BareLossLearner(ShiftLearner):
    def outer_loss(self, params, task):
        return (self.forward_with(params, task["xq"]) - task["yq"]).square().mean()


class _VectorLossLearner(ShiftLearner):
    def outer_loss(self, params, task):
        return (self.forward_with(params, task["xq"]) - task["yq"]).square()


def test_outer_loss_may_return_the_loss_alone_but_must_return_a_scalar():
    torch.manual_seed(0)
    inner, optim = InnerLoopConfig(params=["bias"], steps=2, lr=0.3), OuterOptimConfig()
    bare = _BareLossLearner(nn.Linear(1, 1), inner, optim, 1)
    with_metrics = ShiftLearner(nn.Linear(1, 1), inner, optim, 1)
    with_metrics.load_state_dict(bare.state_dict())
    got, want = bare.evaluate(_shift_batch()), with_metrics.evaluate(_shift_batch())
    assert set(got) == {"query_loss_unadapted", "query_loss_adapted"}
    assert got["query_loss_adapted"] == want["query_loss_adapted"] < want["query_loss_unadapted"]
    share, metrics = bare.pass_loss(bare.split_passes(_shift_batch())[0], batch_size=4)
    assert share.requires_grad and set(metrics) == {"outer_loss", "inner_loss_first", "inner_loss_last"}
    vector = _VectorLossLearner(nn.Linear(1, 1), inner, optim, 1)
    with pytest.raises(ValueError, match=r"outer_loss must return a scalar tensor.*\(8, 1\)"):
        vector.evaluate(_shift_batch())
