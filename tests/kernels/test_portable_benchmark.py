"""benchmarks/portable.py, the GPU script of issue 13, run at toy sizes in the interpreter: every
part records its rows (a failing case as a row, not a crash), and the files and the table come out."""

import csv
import importlib.util
import json
import pathlib

import pytest

from kernels import tiling

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "portable.py"


def load_script():
    spec = importlib.util.spec_from_file_location("portable_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pick(portable, d, *names):
    """The SWEEP entries of head dim d with these names, in this order."""
    by_name = dict(portable.SWEEP[d])
    return [(name, by_name[name]) for name in names]


def read_rows(out):
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.many_compiles
def test_every_part_at_toy_sizes(tmp_path, monkeypatch, capsys):
    portable = load_script()
    monkeypatch.setattr(tiling, "launch_listener", None)
    # head dim 80: the default splits the rows kernel in two launches; a rows and a cols variant
    settings = pick(portable, 128, "default", "rows 128x32 w8, P K late, all in regs", "cols keys in regs")
    monkeypatch.setattr(portable, "SWEEP", {80: settings})
    portable.main(["--smoke", "--out", str(tmp_path), "--families", "1", "--precision-d", "48"])
    rows = read_rows(tmp_path)
    by_part = {}
    for row in rows:
        by_part.setdefault(row["part"], []).append(row)
    sweep = by_part["sweep"]
    assert {(r["part_d"], r["mask"]) for r in sweep} == {("80", "causal"), ("80", "full")}
    assert all(r["status"] == "ok" for r in sweep), [r["status"] for r in sweep]
    assert all(float(r["rel_diff_to_default"]) < 1e-3 and r["deterministic"] == "True" for r in sweep)
    precision = {r["mode"]: r for r in by_part["precision"]}
    assert set(precision) == {"ieee", "tf32x3", "tf32", "fp16"}
    assert all(float(precision[m]["worst_ratio_to_torch"]) < 2 for m in ("ieee", "tf32x3", "tf32"))
    (first,) = by_part["first_call"]
    assert first["status"] == "ok" and float(first["first_total_s"]) > 0
    assert by_part["shared"] and tiling.launch_listener is not None
    table = capsys.readouterr().out.split("part        | case")[-1]
    assert "d80 causal rows 128x32 w8, P K late, all in regs" in table and "first" in table


def test_a_failing_setting_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    portable = load_script()
    monkeypatch.setattr(tiling, "launch_listener", None)
    settings = [("default", {}), ("not a tile", {"bob_cols": {"BLOCK_M": 3}})]
    monkeypatch.setattr(portable, "SWEEP", {16: settings})
    monkeypatch.setattr(portable, "median_ms", lambda fn, rep_ms: 1.0)
    portable.main(["--smoke", "--out", str(tmp_path), "--parts", "sweep"])
    rows = [r for r in read_rows(tmp_path) if r["part"] == "sweep"]
    assert [r["setting"] for r in rows] == ["default", "not a tile", "default"]
    assert rows[0]["status"] == "ok" and rows[1]["status"].startswith("failed: ")
    meta = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()][0]
    assert meta["part"] == "meta" and "limits" in meta


def test_variants_that_beat_the_default_are_combined_and_ranges_are_timed(tmp_path, monkeypatch):
    """The sweep measures the best rows and cols settings together and runs full attention with the
    winner; the ranges part times both paths with and without ranges, twice each."""
    portable = load_script()
    monkeypatch.setattr(tiling, "launch_listener", None)
    settings = pick(portable, 128, "default", "rows q in regs", "cols keys in regs")
    monkeypatch.setattr(portable, "SWEEP", {48: settings})
    monkeypatch.setattr(portable, "median_ms", lambda fn, rep_ms: 2.0 / (1 + len(tiling._overrides)))
    portable.main(["--smoke", "--out", str(tmp_path), "--parts", "sweep,ranges"])
    rows = read_rows(tmp_path)
    sweep = [(r["mask"], r["setting"]) for r in rows if r["part"] == "sweep"]
    both = "rows q in regs + cols keys in regs"
    assert sweep == [("causal", "default"), ("causal", "rows q in regs"), ("causal", "cols keys in regs"),
                     ("causal", both), ("full", "default"), ("full", both)]
    assert all(r["status"] == "ok" for r in rows if r["part"] == "sweep")
    assert all(float(r["err_ratio_to_torch"]) < 1 for r in rows if r["part"] == "sweep")
    ranges = [(r["part_d"], r["path"], r["setting"], r["repeat"]) for r in rows if r["part"] == "ranges"]
    assert sorted(ranges) == sorted((d, path, setting, repeat) for d in ("128", "64")
                                    for path in ("launcher", "flash_attention")
                                    for setting in ("none", "full") for repeat in ("1", "2"))


def test_causal_settings_leave_the_combination_and_full_attention_their_budget(tmp_path, monkeypatch):
    """Each setting's first call costs 15 s of a fake clock; a 70 s budget over 4 settings (+3): the
    causal settings may start until 40 s, the combination and full attention until 70 s."""
    portable = load_script()
    monkeypatch.setattr(tiling, "launch_listener", None)
    settings = pick(portable, 128, "default", "rows q in regs", "cols keys in regs", "rows P K late")
    monkeypatch.setattr(portable, "SWEEP", {16: settings})
    monkeypatch.setattr(portable, "median_ms", lambda fn, rep_ms: 2.0 / (1 + len(tiling._overrides)))
    clock = [0.0]

    def first_call(fn):
        fn()
        clock[0] += 15.0
        return 15.0

    monkeypatch.setattr(portable, "seconds", first_call)
    monkeypatch.setattr(portable.time, "monotonic", lambda: clock[0])
    portable.main(["--smoke", "--out", str(tmp_path), "--parts", "sweep", "--budget-sweep", "70"])
    rows = [(r["mask"], r["setting"], r["status"]) for r in read_rows(tmp_path) if r["part"] == "sweep"]
    both = "rows q in regs + cols keys in regs"
    assert rows == [("causal", "default", "ok"), ("causal", "rows q in regs", "ok"),
                    ("causal", "cols keys in regs", "ok"), ("causal", "rows P K late", "skipped: budget"),
                    ("causal", both, "ok"), ("full", "default", "ok"), ("full", both, "skipped: budget")]


def test_unknown_part_is_refused():
    with pytest.raises(SystemExit):
        load_script().parse_args(["--parts", "sweep,speed"])


def test_precision_and_first_call_run_under_named_fp32_settings(tmp_path, monkeypatch):
    """--precision-settings runs each float32 mode under each named FP32_SETTINGS entry (its
    overrides active while it is measured; the low-precision mode only with the default), in order
    across head dims; --first-call-families / --first-call-settings start one fresh process per
    (family, setting) and record which."""
    portable = load_script()
    monkeypatch.setattr(tiling, "launch_listener", None)
    active = []
    monkeypatch.setattr(portable, "median_ms",
                        lambda fn, rep_ms: active.append(dict(tiling._overrides)) or 1.0)
    portable.main(["--smoke", "--out", str(tmp_path), "--parts", "precision,first_call",
                   "--precision-d", "48,80", "--precision-modes", "tf32x3,low",
                   "--precision-settings", "default,f4c7a04,cols 1 stage",
                   "--first-call-families", "2", "--first-call-settings", "default,f4c7a04"])
    rows = read_rows(tmp_path)
    precision = [(r["mode"], r["setting"], r["part_d"], r["status"])
                 for r in rows if r["part"] == "precision"]
    assert precision == [("tf32x3", "default", "48", "ok"), ("tf32x3", "default", "80", "ok"),
                         ("tf32x3", "f4c7a04", "48", "ok"), ("tf32x3", "f4c7a04", "80", "ok"),
                         ("tf32x3", "cols 1 stage", "80", "ok"),
                         ("fp16", "default", "48", "ok"), ("fp16", "default", "80", "ok")]
    f4c7a04 = {48: portable.fp32_settings(48, "f4c7a04"), 80: portable.fp32_settings(80, "f4c7a04")}
    assert f4c7a04[48]["bob_cols"] == {"maxnreg": None}
    assert f4c7a04[80]["bob_cols"] == {"maxnreg": None, "BLOCK_N": 32, "num_stages": 1}
    # two timings per row (forward + backward, BoB), each under its row's overrides
    assert active[4:6] == [f4c7a04[48]] * 2 and active[6:8] == [f4c7a04[80]] * 2 and active[:4] == [{}] * 4
    assert active[8] == {"bob_cols": {"num_stages": 1}} and active[10:] == [{}] * 4
    assert all(float(r["worst_ratio_to_torch"]) < 2
               for r in rows if r["part"] == "precision" and r["mode"] == "tf32x3")
    first = [(r["dtype"], r["part_d"], r["setting"], r["status"]) for r in rows if r["part"] == "first_call"]
    assert sorted(first) == [("fp32", "64", "default", "ok"), ("fp32", "64", "f4c7a04", "ok")]
    assert {r["precompile"] for r in rows if r["part"] == "first_call"} == {"True"}  # on by default
    assert {json.loads(r["override"]) == f4c7a04[48] for r in rows
            if r["part"] == "first_call" and r["setting"] == "f4c7a04"} == {True}


def test_unknown_fp32_settings_and_families_are_refused():
    portable = load_script()
    for argv in (["--precision-settings", "default,fastest"], ["--first-call-settings", "nope"],
                 ["--precision-modes", "bf16x3"], ["--first-call-families", "99"]):
        with pytest.raises(SystemExit):
            portable.parse_args(argv)


@pytest.mark.many_compiles
def test_the_tma_settings_run_in_the_sweep(tmp_path, monkeypatch):
    """The sweep's TMA settings at toy sizes (the interpreter: no warp specialisation, the same
    masks and descriptor loads): each runs, agrees with the default and is recorded ok."""
    portable = load_script()
    monkeypatch.setattr(tiling, "launch_listener", None)
    monkeypatch.setattr(portable, "SWEEP", {48: [("default", {}), *portable.TMA_SETTINGS]})
    monkeypatch.setattr(portable, "median_ms", lambda fn, rep_ms: 1.0)
    portable.main(["--smoke", "--out", str(tmp_path), "--parts", "sweep"])
    rows = [r for r in read_rows(tmp_path) if r["part"] == "sweep" and r["mask"] == "causal"]
    assert [r["setting"] for r in rows] == ["default", *(name for name, _ in portable.TMA_SETTINGS)]
    assert all(r["status"] == "ok" and float(r["rel_diff_to_default"]) < 1e-3 for r in rows), rows
