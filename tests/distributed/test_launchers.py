"""Processes started by a launcher, one command per process, as on several nodes: two "nodes" of one CPU
process each on localhost, started by two torchrun commands (--nnodes=2, --node_rank 0 and 1), with
trainer.num_nodes=2; Lightning reads ranks and world size from torchrun's environment. The run reaches the
parameters of one process over the global batch (float64, plain SGD, tolerance 1e-12), under ddp and
fsdp; rank 1 finds the run directory by run.name. About 20 s per strategy on 2 cores."""

import os
import socket
import subprocess
import sys

import pytest
from test_ddp import COMMON, REPO, TIMEOUT_S, TINY_RECIPES, assert_same_state, train


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_started_by_torchrun_reach_the_parameters_of_one_process(strategy, tmp_path):
    (tmp_path / "one").mkdir()
    one = train(tmp_path / "one", "maml_longctx", "one", "trainer.meta_batch_size=4")
    args = ["recipe=maml_longctx", *TINY_RECIPES["maml_longctx"], *COMMON, "trainer.meta_batch_size=2"]
    args += [f"trainer.strategy={strategy}", "trainer.devices=1", "trainer.num_nodes=2", "run.name=nodes"]
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "TTT_RUN_DIR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "-m",
                "ttt.train",
                *args,
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=TIMEOUT_S)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert_same_state(tmp_path / "runs" / "nodes", one)
