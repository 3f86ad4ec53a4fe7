"""A tiny trained TTT-E2E run (bytes, data.packing=stream: BOS 256 before every document), shared by the
tests of the commands that use a run: ttt.generate and ttt.evaluate."""

import pytest
from tiny_configs import tiny_text_run, write_tiny_corpus

from ttt.train import main

LM_RUN = ["run.name=lm", "data.packing=stream", "model.vocab_size=260", "ttt.lr_warmup_steps=4"]
"""Two outer steps into a warm-up of four: the inner learning rates of the run's last step are not the
first step's."""


@pytest.fixture(scope="session")
def lm_run(tmp_path_factory):
    """The run directory of a two-step ttt_e2e run at toy size."""
    root = tmp_path_factory.mktemp("lm_run")
    corpus = write_tiny_corpus(root / "corpus")
    assert main(tiny_text_run("ttt_e2e", corpus, root, *LM_RUN)) == 0
    return root / "lm"
