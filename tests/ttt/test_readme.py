"""The README's MetaLearner example runs as written (the code block is read from README.md)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example(marker: str) -> str:
    """The README's python code block that contains `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    matching = [block for block in blocks if marker in block]
    assert len(matching) == 1, f"expected one python block of README.md with {marker!r}, got {len(matching)}"
    return matching[0]


def test_the_readme_meta_learner_example_runs_and_adaptation_helps(tmp_path, monkeypatch):
    code = readme_example("class LineLearner(MetaLearner)")
    assert "Trainer(" in code and "inference_mode=False" in code and "TaskDataModule(" in code
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    results = namespace["results"]
    assert results["test/query_loss_adapted"] < 0.3 * results["test/query_loss_unadapted"]
    assert namespace["trainer"].global_step == namespace["steps"]
    assert not list(tmp_path.iterdir())  # the example writes nothing
