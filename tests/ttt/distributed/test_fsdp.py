"""trainer.strategy=fsdp (ttt.meta.sharding) with 2 CPU processes (gloo on localhost), through the command
line, in float64: an FSDP outer step reaches the parameters of one process over the global batch, for MAML
(maml_longctx) and TTT-E2E with a checkpointed inner loop (ttt_e2e, inner.checkpoint=true), with plain SGD
(so the parameters after a step are the initial ones minus lr times the outer gradient: equal parameters
are equal outer gradients) and with AdamW under outer clipping (the optimizer state and the global norm
over shards); checkpoints written under fsdp resume under fsdp and in one process; fsdp on one device
with CPU offload. Tolerance 1e-12 (the runs sum the same terms in different orders; seen: 6e-17)."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_ddp import assert_same_state, launch, train

# Processes started per test, tens of seconds each on two cores; one such test at a time (pytest -n 2
# with --dist loadgroup, pyproject.toml) so that their processes do not compete with each other.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("processes")]

FSDP = ["trainer.strategy=fsdp", "trainer.devices=2"]
CHECKPOINTED = ["inner.checkpoint=true"]
ADAMW = ["optim.name=adamw", "optim.lr=0.01", "optim.grad_clip=0.05", "optim.weight_decay=0.01"]
"""AdamW with a clip norm below the toy models' gradient norms, so every step clips."""


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """(recipe, overrides) -> the run directory of one process with meta_batch_size 4."""
    runs = {}

    def run(recipe: str, *overrides: str) -> Path:
        key = (recipe, *overrides)
        if key not in runs:
            runs[key] = train(
                tmp_path_factory.mktemp("one"), recipe, "one", "trainer.meta_batch_size=4", *overrides
            )
        return runs[key]

    return run


def optimizer_moments(run: Path) -> list[torch.Tensor]:
    """AdamW's first and second moments of every parameter, in the optimizer's order."""
    (state,) = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["optimizer_states"]
    order = [name for group in state["param_groups"] for name in group["params"]]
    return [state["state"][name][key] for name in order for key in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize(
    "recipe, overrides",
    [("maml_longctx", []), ("ttt_e2e", CHECKPOINTED), ("maml_longctx", ADAMW)],
    ids=["maml_longctx-sgd", "ttt_e2e-checkpointed-sgd", "maml_longctx-adamw-clipped"],
)
def test_fsdp_steps_reach_the_parameters_of_one_process(recipe, overrides, one_process, tmp_path):
    one = one_process(recipe, *overrides)
    fsdp = train(tmp_path, recipe, "fsdp", "trainer.meta_batch_size=2", *overrides, *FSDP)
    assert_same_state(fsdp, one)
    if overrides == ADAMW:
        for got, want in zip(optimizer_moments(fsdp), optimizer_moments(one), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_fsdp_checkpoints_resume_under_fsdp_and_in_one_process(one_process, tmp_path):
    reference = one_process("maml_longctx", *ADAMW)
    first = train(
        tmp_path, "maml_longctx", "fsdp", "trainer.meta_batch_size=2", "trainer.max_steps=1", *ADAMW, *FSDP
    )
    single = tmp_path / "runs" / "single"
    shutil.copytree(first, single)
    launch([sys.executable, "-m", "ttt.train", f"resume={first}", "trainer.max_steps=2"], tmp_path)
    assert_same_state(first, reference)
    one_process_overrides = ["trainer.strategy=auto", "trainer.devices=1", "trainer.meta_batch_size=4"]
    launch(
        [
            sys.executable,
            "-m",
            "ttt.train",
            f"resume={single}",
            "trainer.max_steps=2",
            *one_process_overrides,
        ],
        tmp_path,
    )
    assert_same_state(single, reference)


def test_fsdp_on_one_device_with_cpu_offload_matches_one_process(one_process, tmp_path):
    """World size 1 (the one-GPU setting of docs/distributed.md), offload on: the shards live in CPU memory
    (here the device is the CPU too, so the copies are no-ops; the code path is the GPU's)."""
    one = one_process("ttt_e2e", *CHECKPOINTED)
    offloaded = ["trainer.strategy=fsdp", "trainer.devices=1", "trainer.fsdp_cpu_offload=true"]
    run = train(tmp_path, "ttt_e2e", "offload", "trainer.meta_batch_size=4", *CHECKPOINTED, *offloaded)
    assert_same_state(run, one)
