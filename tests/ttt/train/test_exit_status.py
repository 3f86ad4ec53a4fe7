"""`ttt.train.cli`, the command line's entry: a process of a run of several processes (one that has, or
has released, a process group) ends with os._exit and main's status, past the interpreter's finalization
where gloo's threads can abort it; any other process exits as usual."""

import pytest
import torch

from ttt import train


@pytest.fixture
def exits(monkeypatch):
    """The statuses os._exit was called with (it raises SystemExit here instead of ending pytest)."""
    calls = []

    def fake_exit(status):
        calls.append(status)
        raise SystemExit(f"os._exit({status})")

    monkeypatch.setattr(train.os, "_exit", fake_exit)
    monkeypatch.setattr(train, "main", lambda: 2)
    return calls


@pytest.mark.parametrize("group", ["initialized", "released"])
def test_a_process_of_a_run_of_several_ends_with_os_exit_and_mains_status(group, exits, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: group == "initialized")
    monkeypatch.setattr(train, "_released_a_group", group == "released")
    with pytest.raises(SystemExit):
        train.cli()
    assert exits == [2]


def test_a_process_without_a_process_group_exits_as_usual(exits, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(train, "_released_a_group", False)
    with pytest.raises(SystemExit) as ended:
        train.cli()
    assert ended.value.code == 2 and exits == []
