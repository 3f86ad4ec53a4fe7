"""Training time is logged and carried across a resume; `python -m ttt.tracking.curves` overlays runs
against the outer step or that time, and draws one run's curves into its own directory."""

import csv

from tables import markdown_tables

from ttt.tracking import curves
from ttt.train import main


def _logged_times(run, version):
    with (run / "logs" / f"version_{version}" / "metrics.csv").open() as handle:
        return [float(row["train/time_s"]) for row in csv.DictReader(handle) if row.get("train/time_s")]


def test_training_time_is_logged_and_continues_after_resume(tiny_overrides, tmp_path):
    assert main(tiny_overrides("maml_sinusoid", "run.name=clock", "trainer.log_every_n_steps=1")) == 0
    first = _logged_times(tmp_path / "clock", 0)
    assert len(first) == 2 and 0 < first[0] < first[1]
    assert main([f"resume={tmp_path / 'clock'}", "trainer.max_steps=4"]) == 0
    second = _logged_times(tmp_path / "clock", 1)
    assert len(second) == 2 and first[1] < second[0] < second[1], (first, second)


def test_curves_overlay_runs_by_step_and_by_time(tiny_overrides, tmp_path, capsys):
    for name in ("one", "two"):
        assert main(tiny_overrides("maml_longctx", f"run.name={name}", "trainer.log_every_n_steps=1")) == 0
    runs = [str(tmp_path / "one"), str(tmp_path / "two")]
    for axis in ("step", "time"):
        out = tmp_path / f"cmp_{axis}"
        assert curves.main([*runs, "--out", str(out), "--x", axis, "--metric", "val/query_loss_adapted"]) == 0
        (table,) = markdown_tables((out / "curves.md").read_text())
        assert list(table) == ["one", "two"]
        assert all(float(row["val/query_loss_adapted (last)"]) > 0 for row in table.values())
        assert (out / "curves.png").stat().st_size > 0
    assert curves.main([*runs, "--out", str(tmp_path / "bad"), "--metric", "val/no_such_metric"]) == 2
    assert "no run logged 'val/no_such_metric'" in capsys.readouterr().err
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "bad")]) == 2
    assert "no logs/ directory" in capsys.readouterr().err


def test_curves_of_one_run_go_to_its_directory_by_default(tiny_overrides, tmp_path, capsys):
    """No --out: the run's directory, with the default metrics it logged (maml_sinusoid has no accuracy);
    several runs need --out."""
    assert main(tiny_overrides("maml_sinusoid", "run.name=one", "trainer.log_every_n_steps=1")) == 0
    run = tmp_path / "one"
    assert curves.main([str(run)]) == 0
    (table,) = markdown_tables((run / "curves.md").read_text())
    assert list(table) == ["one"] and float(table["one"]["val/query_loss_adapted (last)"]) > 0
    assert (run / "curves.png").stat().st_size > 0
    assert curves.main([str(run), str(run)]) == 2
    assert "--out DIR is needed to overlay 2 runs" in capsys.readouterr().err
