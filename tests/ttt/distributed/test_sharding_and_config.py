"""Without processes: how tasks are split over processes, and which strategies and combinations the config
refuses."""

import datasets
import pytest

from recipes import load_config
from ttt.config import ConfigError
from ttt.meta.data import StepAlignedSampler, process_share
from ttt.train import main


def test_processes_read_the_tasks_of_one_process_with_the_global_batch():
    one = list(StepAlignedSampler(3, 4, lambda: 5))
    ranks = [list(StepAlignedSampler(3, 2, lambda: 5, rank=r, world_size=2)) for r in range(2)]
    for step in range(3):
        per_rank = [indices[2 * step : 2 * step + 2] for indices in ranks]
        assert per_rank[0] + per_rank[1] == one[4 * step : 4 * step + 4]
    assert one[0] == 5 * 4


def test_held_out_tasks_split_into_equal_contiguous_shares():
    tasks = datasets.Dataset.from_dict({"i": list(range(6))})
    shares = [process_share(tasks, rank=r, world_size=3)["i"] for r in range(3)]
    assert shares == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="do not split evenly"):
        process_share(tasks, rank=0, world_size=4)


def test_deepspeed_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as error:
        load_config(["recipe=maml_longctx", "trainer.strategy=deepspeed", "trainer.devices=2"])
    message = str(error.value)
    assert "trainer.strategy=deepspeed is not supported" in message
    for reason in ("functional_call", "create_graph=True", "use trainer.strategy=fsdp"):
        assert reason in message


def test_held_out_counts_must_split_over_the_devices():
    with pytest.raises(ConfigError, match=r"trainer.test_tasks \(5\) must be a multiple of trainer.devices"):
        load_config(["recipe=maml_sinusoid", "trainer.devices=2", "trainer.test_tasks=5"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.name=sophia_h"], "optim.name=sophia_h is not supported with trainer.strategy=fsdp"),
        (
            ["trainer.precision=16-mixed"],
            "trainer.precision=16-mixed is not supported with trainer.strategy=fsdp",
        ),
    ],
    ids=["hessian-optimizer", "fp16"],
)
def test_what_fsdp_cannot_run_is_refused_by_name_before_the_run_directory(
    overrides, message, tmp_path, capsys
):
    args = ["recipe=maml_sinusoid", "trainer.strategy=fsdp", f"run.root={tmp_path}", *overrides]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_cpu_offload_needs_fsdp():
    with pytest.raises(ConfigError, match="trainer.fsdp_cpu_offload=true needs trainer.strategy=fsdp"):
        load_config(["recipe=maml_sinusoid", "trainer.fsdp_cpu_offload=true"])
