"""Resume never touches the run directory when it fails; every unreadable checkpoint names its file and
what to do (never torch's advice to load with weights_only=False)."""

import pytest

from ttt.tracking import CheckpointError, load_checkpoint
from ttt.train import main


@pytest.fixture
def finished_run(tiny_overrides, tmp_path):
    """A finished tiny run directory (2 outer steps)."""
    assert main(tiny_overrides("maml_sinusoid", "run.name=A")) == 0
    return tmp_path / "A"


def _files(run):
    return {path.relative_to(run): path.read_bytes() for path in sorted(run.rglob("*")) if path.is_file()}


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
