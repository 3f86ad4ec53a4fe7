"""Shared settings of the ttt tests: tiny recipe overrides that run in seconds on the CPU."""

import pytest

TINY_TRAINER = [
    "trainer.max_steps=2",
    "trainer.steps_per_epoch=2",
    "trainer.meta_batch_size=2",
    "trainer.val_tasks=2",
    "trainer.test_tasks=4",
    "trainer.eval_batch_size=2",
    "trainer.progress_bar=false",
    "trainer.accelerator=cpu",
    "run.tensorboard=false",
]

TINY_RECIPES = {
    "maml_longctx": [
        "model.d_model=32",
        "model.n_heads=2",
        "model.window=8",
        "model.vocab_size=32",
        "task.n_pairs=4",
        "task.n_queries=3",
        "task.n_keys=8",
        "task.n_values=8",
        "task.n_filler_tokens=4",
        "task.filler_len=14",
        "context.chunk_len=8",
        "inner.steps=2",
    ],
    "maml_sinusoid": ["model.hidden_sizes=[8,8]", "inner.eval_steps=2"],
}


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides that shrink a recipe to a seconds-long run writing under tmp_path."""

    def make(recipe: str, *extra: str) -> list[str]:
        return [f"recipe={recipe}", *TINY_RECIPES[recipe], *TINY_TRAINER, f"run.root={tmp_path}", *extra]

    return make
