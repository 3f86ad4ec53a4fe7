"""Resume never touches the run directory when it fails or has nothing to do; every unreadable checkpoint
names its file and what to do (never torch's advice to load with weights_only=False); a place the run
cannot write is refused before any work, naming the path and the key."""

import errno
import os

import pytest

import ttt.train
from recipes import load_config
from ttt.config import ConfigError
from ttt.tracking import CheckpointError, load_checkpoint
from ttt.train import check_kept_on_resume, main


@pytest.fixture
def finished_run(tiny_overrides, tmp_path):
    """A finished tiny run directory (2 outer steps)."""
    assert main(tiny_overrides("maml_sinusoid", "run.name=A")) == 0
    return tmp_path / "A"


def _files(run):
    """Every path under `run` (directories too) -> its bytes (None for a directory) and modification time."""
    return {
        path.relative_to(run): (path.read_bytes() if path.is_file() else None, path.stat().st_mtime_ns)
        for path in sorted(run.rglob("*"))
    }


def test_resume_with_a_model_change_leaves_the_run_directory_untouched(finished_run, capsys):
    before = _files(finished_run)
    assert main([f"resume={finished_run}", "model.hidden_sizes=[16,16]"]) == 2
    err = capsys.readouterr().err
    assert "does not fit the model" in err and "model.layers" in err and "(8, 1)" in err
    assert _files(finished_run) == before  # config.yaml byte-identical, no new log version
    assert main([f"resume={finished_run}", "trainer.max_steps=4"]) == 0


CORRUPTIONS = {
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "random bytes": lambda data: bytes(range(256)) * 8,
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_checkpoint_names_the_file_and_what_to_do(finished_run, kind, capsys):
    checkpoint = finished_run / "checkpoints" / "last.ckpt"
    checkpoint.write_bytes(CORRUPTIONS[kind](checkpoint.read_bytes()))
    config = (finished_run / "config.yaml").read_bytes()
    assert main([f"resume={finished_run}"]) == 2
    err = capsys.readouterr().err
    assert str(checkpoint) in err and "resume from another checkpoint" in err
    assert "weights_only=False" not in err and "Traceback" not in err
    assert (finished_run / "config.yaml").read_bytes() == config
    with pytest.raises(CheckpointError, match="truncated|empty|not a PyTorch checkpoint"):
        load_checkpoint(checkpoint)


def test_checkpoint_with_arbitrary_objects_is_refused_safely(tmp_path):
    import torch

    path = tmp_path / "odd.ckpt"
    torch.save({"state_dict": {}, "thing": CheckpointError("x")}, path)
    with pytest.raises(CheckpointError, match=r"odd\.ckpt holds Python objects") as info:
        load_checkpoint(path)
    assert "weights_only=False" not in str(info.value)


def test_a_resume_asking_for_fewer_steps_than_were_trained_is_refused(finished_run, capsys):
    before = _files(finished_run)
    assert main([f"resume={finished_run}", "trainer.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "trained 2 outer steps, more than trainer.max_steps=1" in err and "Traceback" not in err
    assert _files(finished_run) == before


@pytest.mark.parametrize("extra", [[], ["trainer.max_steps=2"]], ids=["as-saved", "same-max-steps"])
def test_resuming_a_finished_run_has_nothing_to_do(finished_run, extra, capsys):
    before = _files(finished_run)
    assert main([f"resume={finished_run}", *extra]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert _files(finished_run) == before


def test_a_resume_cannot_change_what_the_saved_optimizer_keeps(finished_run, capsys):
    """The optimizer comes back from the checkpoint with its lr and betas: an override would be ignored."""
    before = _files(finished_run)
    assert main([f"resume={finished_run}", "trainer.max_steps=4", "optim.lr=0.1", "optim.beta1=0.5"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr=0.1 (the run's: 0.001), optim.beta1=0.5 (the run's: 0.9) cannot change on resume" in err
    assert _files(finished_run) == before


def test_a_resume_cannot_change_the_learnable_inner_lrs_lr(tiny_overrides, tmp_path, capsys):
    """The learnable inner lrs have a parameter group of their own at inner.lr_outer_lr, which the
    checkpoint brings back as saved."""
    learnable = ("inner.learnable_lr=tensor", "inner.lr_outer_lr=0.01")
    assert main(tiny_overrides("maml_sinusoid", *learnable, "run.name=L")) == 0
    run = tmp_path / "L"
    before = _files(run)
    assert main([f"resume={run}", "trainer.max_steps=4", "inner.lr_outer_lr=0.1"]) == 2
    assert "inner.lr_outer_lr=0.1 (the run's: 0.01) cannot change on resume" in capsys.readouterr().err
    assert _files(run) == before
    assert main([f"resume={run}", "trainer.max_steps=4"]) == 0


def test_a_resume_cannot_change_an_optimizer_comparisons_baseline_lr():
    saved = load_config(["recipe=sophia_lm"])
    resumed = load_config(["recipe=sophia_lm", "compare.baseline_lr=0.01"])
    resumed.resume = "runs/S"
    with pytest.raises(ConfigError, match=r"compare.baseline_lr=0.01 \(the run's: 0.002\) cannot change"):
        check_kept_on_resume(saved, resumed)
    check_kept_on_resume(saved, load_config(["recipe=sophia_lm", "optim.warmup_steps=3"]))


@pytest.fixture
def read_only(monkeypatch):
    """read_only(directory): makes `directory` read-only as a read-only file system would, for root too
    (whom chmod does not stop): os.access denies writing there, and creating a file or a directory there
    raises OSError(EROFS)."""
    real_access, real_open, real_mkdir = os.access, os.open, os.mkdir
    places = []

    def inside(path, *, itself: bool = False) -> bool:
        path = os.path.abspath(path)
        return any(path.startswith(f"{place}{os.sep}") or (itself and path == place) for place in places)

    def refused(path):
        return OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    def guarded_access(path, mode, *args, **kwargs):
        return not (mode & os.W_OK and inside(path, itself=True)) and real_access(path, mode, *args, **kwargs)

    def guarded_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and inside(path):
            raise refused(path)
        return real_open(path, flags, *args, **kwargs)

    def guarded_mkdir(path, *args, **kwargs):
        if inside(path):
            raise refused(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "access", guarded_access)
    monkeypatch.setattr(os, "open", guarded_open)
    monkeypatch.setattr(os, "mkdir", guarded_mkdir)
    return lambda directory: places.append(os.path.abspath(directory))


def test_a_read_only_run_root_is_refused_before_any_work(
    tiny_overrides, tmp_path, read_only, capsys, monkeypatch
):
    (tmp_path / "ro").mkdir()
    read_only(tmp_path / "ro")
    runs = tmp_path / "ro" / "runs"
    monkeypatch.setattr(ttt.train, "run", lambda *args, **kwargs: pytest.fail("the run started"))
    assert main(tiny_overrides("maml_sinusoid", f"run.root={runs}")) == 2
    assert f"run.root={runs}: cannot write in {tmp_path / 'ro'} (" in capsys.readouterr().err
    assert list((tmp_path / "ro").iterdir()) == []
    (tmp_path / "file").write_text("x")  # a run.root below a file: no chmod or monkeypatch needed
    assert main(tiny_overrides("maml_sinusoid", f"run.root={tmp_path / 'file' / 'runs'}")) == 2
    assert f"{tmp_path / 'file'} is a file, not a directory" in capsys.readouterr().err


def test_a_read_only_run_directory_is_refused_on_resume(finished_run, read_only, capsys):
    before = _files(finished_run)
    read_only(finished_run / "checkpoints")
    assert main([f"resume={finished_run}", "trainer.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert f"resume={finished_run}: cannot write in {finished_run / 'checkpoints'} (" in err
    assert "Traceback" not in err and _files(finished_run) == before
