"""Every python block of README.md runs as written (read from the file), on the CPU."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def run(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


def block(marker: str) -> str:
    """The README's python block that contains `marker`."""
    matching = [code for code in BLOCKS if marker in code]
    assert len(matching) == 1, f"expected one python block of README.md with {marker!r}, got {len(matching)}"
    return matching[0]


def test_every_python_block_is_run_by_a_test():
    markers = ("flashbob.flash_attention(q, k, v", 'attn_implementation="bob"', "class LineLearner")
    assert sorted(BLOCKS) == sorted(block(marker) for marker in markers)


def test_the_kernels_example_differentiates_twice_and_through_the_jvp():
    namespace = run(block("flashbob.flash_attention(q, k, v"))
    q = namespace["q"]
    assert [g.shape for g in namespace["meta"]] == [q.shape, namespace["k"].shape, namespace["v"].shape]
    assert all(torch.isfinite(g.float()).all() and g.abs().sum() > 0 for g in namespace["meta"])
    assert namespace["g_q"][0].shape == q.shape


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_the_transformers_example_takes_a_second_order_gradient():
    namespace = run(block('attn_implementation="bob"'))
    assert namespace["model"].config._attn_implementation == "bob"
    assert all(g.requires_grad for g in namespace["grads"])


def test_the_meta_learner_example_runs_adaptation_helps_and_the_learner_reloads(tmp_path, monkeypatch):
    code = block("class LineLearner(MetaLearner)")
    monkeypatch.chdir(tmp_path)
    namespace = run(code)
    results = namespace["results"]
    assert results["test/query_loss_adapted"] < 0.3 * results["test/query_loss_unadapted"]
    assert namespace["trainer"].global_step == namespace["steps"]
    assert not list(tmp_path.iterdir())  # the example writes nothing
    # The trained learner reloaded from its checkpoint, adapted to a new line and predicting it.
    loaded, trained = namespace["learner"], namespace["trainer"].lightning_module
    assert loaded is not trained and type(loaded) is type(trained) and not loaded.training
    assert loaded.global_step == namespace["steps"]
    for name, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    task, params, initial = namespace["task"], namespace["params"], loaded.initial_params()
    assert params.keys() == initial.keys() and not torch.equal(params["2.weight"], initial["2.weight"])
    y_query = torch.as_tensor(task["y_query"])
    adapted = (namespace["y"] - y_query).square().mean()
    unadapted = (loaded.predict(initial, task["x_query"]) - y_query).square().mean()
    assert namespace["y"].shape == (5, 1) and adapted < 0.1 * unadapted  # measured: 0.014 and 0.49
