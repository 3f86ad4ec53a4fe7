"""Test-wide setup. Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be
switched on before triton is first imported. The fixture `tiny_overrides` shrinks a recipe to a
seconds-long CPU run."""

import glob
import os

if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from tiny_configs import TINY_KV_MODEL, TINY_KV_TASK, TINY_TRAINER  # noqa: E402

TINY_RECIPES = {
    "maml_longctx": [*TINY_KV_MODEL, *TINY_KV_TASK],
    "maml_sinusoid": ["model.hidden_sizes=[8,8]", "inner.eval_steps=2"],
}


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides that shrink a recipe to a seconds-long run writing under tmp_path."""

    def make(recipe: str, *extra: str) -> list[str]:
        tiny = [*TINY_RECIPES[recipe], *TINY_TRAINER, "trainer.test_tasks=4"]
        return [f"recipe={recipe}", *tiny, f"run.root={tmp_path}", *extra]

    return make
