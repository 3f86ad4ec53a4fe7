"""ttt.compile_prefix under trainer.strategy=ddp and fsdp, 2 CPU processes (gloo on localhost), in float64:
the TTT-E2E recipe at toy size with its prefix blocks compiled in every process (compile_everywhere.py:
inductor's C++ kernels) reaches the parameters of one eager process over the global batch."""

from pathlib import Path

import pytest
from test_ddp import assert_same_state, train

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("processes")]

COMPILE_EVERYWHERE = Path(__file__).with_name("compile_everywhere.py")


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    """The run directory of one process with meta_batch_size 4, its prefix eager."""
    return train(tmp_path_factory.mktemp("eager"), "ttt_e2e", "eager", "trainer.meta_batch_size=4")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_prefix_steps_reach_the_parameters_of_one_eager_process(strategy, eager, tmp_path):
    compiled = train(
        tmp_path, "ttt_e2e", "compiled", "trainer.meta_batch_size=2", "ttt.compile_prefix=true",
        f"trainer.strategy={strategy}", "trainer.devices=2", entry=[str(COMPILE_EVERYWHERE)],
    )  # fmt: skip
    assert_same_state(compiled, eager)
