"""What a new user meets first: a missing GPU is named before anything is written, --help lists a
recipe's keys with their docs, redirected logs carry no progress bar, and every run writes plots."""

import pytest
import torch

from ttt.train import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_gpu_accelerator_without_a_gpu_fails_before_the_run_directory(tiny_overrides, tmp_path, capsys):
    assert main(tiny_overrides("maml_sinusoid", "run.name=gpu", "trainer.accelerator=gpu")) == 2
    assert "trainer.accelerator=gpu" in capsys.readouterr().err
    assert not (tmp_path / "gpu").exists()
