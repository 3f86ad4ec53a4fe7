"""Processes started by a launcher, one command per process, as on several nodes: two "nodes" of one CPU
process each on localhost, started by two torchrun commands (--nnodes=2, --node_rank 0 and 1), with
trainer.num_nodes=2; Lightning reads ranks and world size from torchrun's environment. The run reaches the
parameters of one process over the global batch (float64, plain SGD, tolerance 1e-12), under ddp and
fsdp; rank 1 finds the run directory by run.name. About 20 s per strategy on 2 cores."""

import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from test_ddp import COMMON, REPO, TIMEOUT_S, TINY_RECIPES, assert_same_state, train

# Processes started per test, tens of seconds each on two cores; one such test at a time (pytest -n 2
# with --dist loadgroup, pyproject.toml) so that their processes do not compete with each other.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("processes")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_nodes(args: list[str], cwd: Path, logs: Path) -> list[subprocess.Popen]:
    """Two torchrun commands (node ranks 0 and 1, one process each) of `python -m ttt.train *args` on a
    fresh localhost port, writing stdout and stderr to logs/node<rank>.log."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "TTT_RUN_DIR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    logs.mkdir(parents=True)
    nodes = []
    for rank in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
            "-m", "ttt.train", *args,
        ]  # fmt: skip
        with open(logs / f"node{rank}.log", "w") as log:
            nodes.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return nodes


def finish(nodes: list[subprocess.Popen], logs: Path) -> tuple[bool, str]:
    """Wait up to TIMEOUT_S for both nodes (stopping both past it); returns
    (whether both finished in time, both logs' tails)."""
    deadline = time.monotonic() + TIMEOUT_S
    in_time = True
    for node in nodes:
        try:
            node.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            in_time = False
            break
    if not in_time:  # torchrun stops its workers (in sessions of their own) on SIGTERM
        for node in nodes:
            node.terminate()
        for node in nodes:
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
    tails = [
        f"--- node {rank} (exit {node.returncode}):\n{(logs / f'node{rank}.log').read_text()[-3000:]}"
        for rank, node in enumerate(nodes)
    ]
    return in_time, "\n".join(tails)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_started_by_torchrun_reach_the_parameters_of_one_process(strategy, tmp_path):
    (tmp_path / "one").mkdir()
    one = train(tmp_path / "one", "maml_longctx", "one", "trainer.meta_batch_size=4")
    args = ["recipe=maml_longctx", *TINY_RECIPES["maml_longctx"], *COMMON, "trainer.meta_batch_size=2"]
    args += [f"trainer.strategy={strategy}", "trainer.devices=1", "trainer.num_nodes=2"]
    # A pair that hangs (seen once in CI, never reproduced here: the first node's wait timed out with
    # no output kept) is stopped, reported as a warning with both logs, and started once more in a new run
    # directory; a pair that fails, or hangs twice, fails the test.
    for attempt in (1, 2):
        name = f"nodes{attempt}"
        nodes = start_nodes([*args, f"run.name={name}"], tmp_path, tmp_path / f"logs{attempt}")
        in_time, tails = finish(nodes, tmp_path / f"logs{attempt}")
        if in_time:
            break
        assert attempt == 1, f"the two nodes hung twice (over {TIMEOUT_S} s each):\n{tails}"
        warnings.warn(f"the two nodes hung (over {TIMEOUT_S} s), started once more:\n{tails}", stacklevel=1)
    for node in nodes:
        assert node.returncode == 0, tails
    assert_same_state(tmp_path / "runs" / name, one)


def test_a_run_that_ends_releases_its_process_group(tmp_path):
    """`python -m ttt.train` destroys the process group when its run returns (left to the interpreter's
    exit, gloo's threads can abort the process); a group made before the run stands in for Lightning's."""
    import torch.distributed as dist

    from ttt.train import main, release_process_group

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    try:
        assert main(["recipe=maml_sinusoid", *COMMON,
                     f"run.root={tmp_path / 'runs'}", "run.name=run"]) == 0
        assert not dist.is_initialized()
        release_process_group()  # none left: nothing to do
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
