"""A run that runs out of accelerator memory stops with exit status 4 and names the keys of its recipe
that lower memory, with their values and costs, instead of a CUDA trace."""

import torch

from recipes import load_config
from ttt import train
from ttt.tracking import out_of_memory_advice


def test_out_of_memory_names_the_recipes_memory_keys(monkeypatch, capsys):
    def run_out(cfg, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB.")

    monkeypatch.setattr(train, "run", run_out)
    overrides = ["ttt.fused_loss=false", "inner.checkpoint=false", "ttt.checkpoint_prefix=false"]
    status = train.main(["recipe=ttt_e2e_125m", *overrides])
    err = capsys.readouterr().err
    assert status == train.OUT_OF_MEMORY == 4
    assert "Tried to allocate 96.00 MiB" in err
    for line in (
        "ttt.fused_loss: False -> True",
        "ttt.checkpoint_prefix: False -> True",
        "inner.checkpoint: False -> True",
        "ttt.checkpoint_segment: null -> 8",
        "ttt.sequences_per_pass: 16 -> 8",
        "data.seq_len: 8192",
        "inner.first_order: false -> true",
    ):
        assert line in err
    assert "Traceback" not in err


def test_keys_already_saving_memory_and_keys_a_recipe_lacks_are_not_suggested():
    cfg = load_config(["recipe=maml_sinusoid"])
    advice = out_of_memory_advice(cfg, torch.OutOfMemoryError("oom"))
    assert "  ttt." not in advice and "data.seq_len" not in advice
    cfg = load_config(["recipe=ttt_e2e_125m", "ttt.checkpoint_prefix=true", "ttt.sequences_per_pass=1"])
    advice = out_of_memory_advice(cfg, torch.OutOfMemoryError("oom"))
    assert "ttt.checkpoint_prefix" not in advice and "ttt.sequences_per_pass" not in advice
    assert "inner.checkpoint" not in advice  # the recipe recomputes its chunks already
    cfg = load_config(["recipe=ttt_e2e_125m", "ttt.checkpoint_segment=4"])
    assert "ttt.checkpoint_segment" not in out_of_memory_advice(cfg, torch.OutOfMemoryError("oom"))
