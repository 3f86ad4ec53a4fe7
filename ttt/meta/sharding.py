"""trainer.strategy=fsdp: fully sharded data parallelism with exact second-order outer gradients.

Between outer steps, every parameter, its gradient and its optimizer state are sharded across the
processes: a DTensor split along dim 0 (0-dim parameters replicated), the layout of PyTorch's FSDP2
(`fully_shard`), so Lightning's `ModelParallelStrategy` (its FSDP2 strategy) checkpoints them. An outer
step (`OuterLearner.outer_step`) runs inside `gathered_parameters`:

    whole = all-gather of each shard, a fresh leaf tensor on the device        (once per outer step)
    swapped into the module's parameter slots, as torch.func.functional_call does
    every pass: forward, inner loop (create_graph=True), outer loss, backward  (gradients accumulate in
                                                                               whole.grad, as under DDP)
    shard.grad = this process's share of the mean over processes of whole.grad (one reduce-scatter)
    the shards go back into the slots; outer clipping and the optimizer step act on the shards

The inner loop differentiates with respect to the whole tensors like any other (nothing is freed or
re-gathered under a second-order graph), so the outer gradient is exactly that of one process over the
global batch; an activation-checkpointed inner loop recomputes inside the block and sees the same tensors.

Why not `fully_shard`'s own module hooks (tried on CPU/gloo, torch 2.13): they gather a module's
parameters in its forward pre-hook and put them into the module themselves, which overwrites parameters
substituted by `functional_call` (the adapted fast weights), and outside a forward they leave the sharded
DTensors where the inner loop takes its initial weights, so `torch.autograd.grad` finds them unused
("differentiated Tensor ... appears to not have been used in the graph"), with the default settings and
with `set_reshard_after_backward(False)` alike. Unsharding every unit by hand before the pass and keeping
it so (reshard_after_forward=False and reshard_after_backward=False) gave exact gradients on a small MLP,
but its reduce-scatter runs from autograd hooks that fire only around a unit's own forward, which the
learners that read their model through other methods (TTT's `read`) do not call.

The cost: during a step the whole model and its gradients are on each device in the compute dtype (as
under DDP; the second-order graph keeps most weights alive anyway); one all-gather and one reduce-scatter
per parameter per step. What sharding saves is the optimizer state (Adam: 8 bytes per float32 parameter
become 8/N) and the parameters and gradients between steps; with CPU offload (trainer.fsdp_cpu_offload)
the shards, their gradients and the optimizer state live in CPU memory, the optimizer steps there, and each
step copies the shards to the device and the gradient shards back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


class SecondOrderFSDPStrategy(ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` over a 1-D mesh of all processes (data parallel only), whose
    checkpoints are single full files (gathered on rank 0 and written through the Trainer's checkpoint
    IO: they load into one process too). The learner shards its parameters in `configure_model` by
    calling `shard` (`ttt.meta.OuterLearner` does). cpu_offload: keep the shards, their gradients and the
    optimizer state in CPU memory."""

    def __init__(self, world_size: int, *, cpu_offload: bool = False, **kwargs: Any):
        super().__init__(
            data_parallel_size=world_size, tensor_parallel_size=1, save_distributed_checkpoint=False, **kwargs
        )
        self.cpu_offload = cpu_offload

    def shard(self, module: nn.Module) -> None:
        """Shard `module`'s parameters over the processes (idempotent: Lightning calls configure_model at
        every stage)."""
        shard_parameters(module, self.device_mesh["data_parallel"], offload=self.cpu_offload)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        # torch.distributed.checkpoint loads the optimizer state of replicated (0-dim) parameters as plain
        # tensors, which the optimizer's in-place updates cannot combine with the parameters' DTensors.
        for optimizer in self.optimizers:
            for param, state in optimizer.state.items():
                if not isinstance(param, DTensor) or param.placements != (Replicate(),):
                    continue
                for key, value in state.items():
                    if (
                        torch.is_tensor(value)
                        and not isinstance(value, DTensor)
                        and value.shape == param.shape
                    ):
                        local = value.to(param.to_local().device)
                        state[key] = DTensor.from_local(
                            local, param.device_mesh, param.placements, run_check=False
                        )
        return checkpoint

    def model_to_device(self) -> None:
        if not self.cpu_offload:
            super().model_to_device()
            return
        # The shards stay in CPU memory; buffers (rope tables, ...) go to the device, and the module's
        # `device` (where learners put the tensors they create) says the device, as `.to()` would.
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.root_device)
        _update_properties(self.model, device=self.root_device)


def shard_parameters(module: nn.Module, mesh, *, offload: bool = False) -> None:
    """Replace every parameter of `module` that is not a DTensor yet by one sharded along dim 0 over the
    1-D `mesh` (0-dim parameters replicated), scattered from rank 0's values (as DDP broadcasts rank 0's
    parameters). A parameter shared by several modules (tied embeddings) stays shared. offload: the local
    shards in CPU memory."""
    replaced: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) not in replaced:
                placements = [Shard(0)] if param.dim() else [Replicate()]
                sharded = distribute_tensor(param.detach(), mesh, placements)
                if offload:
                    sharded = DTensor.from_local(
                        sharded.to_local().cpu(),
                        mesh,
                        placements,
                        run_check=False,
                        shape=sharded.shape,
                        stride=sharded.stride(),
                    )
                replaced[id(param)] = nn.Parameter(sharded, requires_grad=param.requires_grad)
            submodule._parameters[name] = replaced[id(param)]


def _gather(param: DTensor, device: torch.device) -> torch.Tensor:
    """The whole of a sharded parameter on `device`: a fresh leaf that requires grad as the parameter does."""
    local = param.to_local()
    if local.device != device:  # CPU offload: the shard goes to the device first
        local = local.to(device, non_blocking=True)
    sharded = DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    full = sharded.full_tensor().requires_grad_(param.requires_grad)
    # Stands for the parameter: isinstance(full, nn.Parameter) holds (the flag torch keeps for tensors that
    # act as parameters), so nn.Module.get_parameter, which checks it, returns it like the shard it replaces.
    full._is_param = True
    return full


def _reduce_into_shard(param: DTensor, grad: torch.Tensor) -> None:
    """Average the processes' whole gradients `grad` of `param` and add this process's share to param.grad
    (a reduce-scatter; an all-reduce for a replicated parameter)."""
    mesh = param.device_mesh
    reduced = DTensor.from_local(grad, mesh, [Partial("avg")] * mesh.ndim, run_check=False)
    local = reduced.redistribute(mesh, param.placements).to_local()
    local = local.to(param.to_local().device)  # CPU offload: the gradient shard lives beside its parameter
    shard = DTensor.from_local(
        local, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    if param.grad is None:
        param.grad = shard
    else:
        param.grad += shard


def sharded_parameters(module: nn.Module) -> list[tuple[nn.Module, str, DTensor]]:
    """(submodule, name, parameter) of every DTensor parameter of `module` (none: not sharded)."""
    return [
        (submodule, name, param)
        for submodule in module.modules()
        for name, param in submodule._parameters.items()
        if isinstance(param, DTensor)
    ]


@contextlib.contextmanager
def gathered_parameters(
    module: nn.Module, device: torch.device, *, reduce_gradients: bool = True
) -> Iterator[None]:
    """Inside the block, `module`'s sharded parameters are whole tensors on `device`: leaves, gathered from
    the shards, put in the module's parameter slots the way `torch.func.functional_call` does (so module
    calls, functional calls and named_parameters() all see them). On a normal exit the gradients that the
    block's backward passes accumulated in them are averaged over the processes into the shards' .grad
    (reduce_gradients=False: dropped, for evaluation), and the shards come back. A shared parameter is
    gathered once. A module without sharded parameters is left alone."""
    slots = sharded_parameters(module)
    if not slots:
        yield
        return
    params = {id(param): param for _, _, param in slots}
    with torch.no_grad():
        whole = {key: _gather(param, device) for key, param in params.items()}
    for submodule, name, param in slots:
        submodule._parameters[name] = whole[id(param)]
    try:
        yield
        if reduce_gradients:
            with torch.no_grad():
                for key, param in params.items():
                    if whole[key].grad is not None:
                        _reduce_into_shard(param, whole[key].grad)
    finally:
        for submodule, name, param in slots:
            submodule._parameters[name] = param


def clip_sharded_gradients(params: list[torch.Tensor], max_norm: float, device: torch.device) -> None:
    """Scale the gradients of `params` (DTensor shards, as `shard_parameters` makes them) so that their global
    L2 norm is at most `max_norm`, as torch.nn.utils.clip_grad_norm_ does for whole tensors. The squared
    norms of the local shards are summed over the processes on `device` (with CPU offload the shards are in
    CPU memory, where NCCL does not reach); replicated gradients count once."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        square = grad.to_local().double().square().sum().to(device)
        if all(isinstance(placement, Replicate) for placement in grad.placements):
            replicated += square
        else:
            sharded += square
    mesh = grads[0].device_mesh
    if mesh.size() > 1:
        dist.all_reduce(sharded, group=mesh.get_group())
    coef = (max_norm / ((sharded + replicated).sqrt() + 1e-6)).clamp(max=1.0)
    for grad in grads:
        local = grad.to_local()
        local.mul_(coef.to(local.device, local.dtype))
