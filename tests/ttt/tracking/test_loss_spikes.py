"""A finite loss that jumps well above its best is reported (warning and summary), not stopped: the
1,200-step TTT-E2E run whose loss rose from 2.06 to 2.89 and stayed there passed every other check."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from ttt.tracking import LossSpikeWatch
from ttt.train import main


def _feed(watch, losses):
    for step, loss in enumerate(losses, 1):
        trainer = SimpleNamespace(global_step=step)
        watch.on_train_batch_end(trainer, None, {"loss": torch.tensor(loss)}, None, 0)


def test_a_jump_that_stays_warns_once_at_its_step_and_names_the_keys():
    watch = LossSpikeWatch(rise=0.2, smoothing=0.5, warmup=3, inner_keys="ttt.inner_lr")
    falling = [4.0, 3.0, 2.5, 2.2, 2.1, 2.05] + [2.0] * 8
    message = r"spike at outer step 15: .*22% above its lowest \(2\.00\d*\).*optim\.lr.*ttt\.inner_lr"
    with pytest.warns(UserWarning, match=message):
        _feed(watch, falling + [2.9] * 12)
    assert watch.spike_steps() == [15]  # the first high loss lifts the average 22% (2.45)
    assert watch.spikes[0]["best_ema"] == pytest.approx(2.0, rel=0.02)


def test_noise_and_the_early_fall_are_not_spikes():
    watch = LossSpikeWatch(rise=0.2, smoothing=0.05, warmup=20)
    early = [8.0 - 0.3 * i for i in range(20)]  # falls fast while the average lags
    noisy = [2.0 + 0.5 * math.sin(i) for i in range(300)]  # +-25% per step, the average stays level
    _feed(watch, early + noisy)
    assert watch.spike_steps() == []


def test_a_recovered_spike_rearms_and_a_second_one_is_recorded():
    watch = LossSpikeWatch(rise=0.2, smoothing=1.0, warmup=0)
    _feed(watch, [2.0, 2.0, 3.0, 3.0, 2.0, 2.0, 3.0])
    assert watch.spike_steps() == [3, 7]


def test_non_finite_losses_are_left_to_the_divergence_guard():
    watch = LossSpikeWatch(warmup=0)
    _feed(watch, [2.0, float("nan"), float("inf"), 2.0])
    assert watch.ema == 2.0 and watch.spike_steps() == []


def test_state_survives_a_resume():
    watch = LossSpikeWatch(rise=0.2, smoothing=1.0, warmup=0)
    _feed(watch, [2.0, 3.0])
    restored = LossSpikeWatch()
    restored.load_state_dict(watch.state_dict())
    assert (restored.ema, restored.best, restored.spiking, restored.spike_steps()) == (3.0, 2.0, True, [2])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rise > 0"):
        LossSpikeWatch(rise=0)
    with pytest.raises(ValueError, match="smoothing"):
        LossSpikeWatch(smoothing=1.5)


def test_the_summary_lists_the_spike_steps(tiny_overrides, tmp_path):
    assert main(tiny_overrides("maml_sinusoid", "run.name=calm")) == 0
    summary = json.loads((tmp_path / "calm" / "summary.json").read_text())
    assert summary["loss_spike_steps"] == []
