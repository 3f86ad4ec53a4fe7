"""What a neural memory's writes do, measured on held-out text: are they visible, aimed, and used?

    python -m ttt.experiments.neural_memory_diagnose recipe=neural_memory [key=value ...]  # initial
    python -m ttt.experiments.neural_memory_diagnose run=RUN_DIR [key=value ...]  # a trained run
    python -m ttt.experiments.neural_memory_diagnose --help

One training-mode read (every write, second order as in training) of `rows` test windows, then its
backward, and one read of the same windows without writes. Per memory block and chunk (then averaged):

    read      |r| / |h|              the read's size against the block's normalised input h
              |r - r_0| / |h|        what the writes so far add to it (r_0: the read of the initial memory)
    keys      mean cos(k_s, k_t)     over the write's pairs s != t of a chunk (1: one shared direction)
    queries   mean cos(q_s, q_t)     the same for the read's queries
    write     <dM, e> / |e|^2        one write from zero surprise: how far M(k) moves along its error
                                     e = v - M(k), for the written keys (1: each written exactly)
              clip factor            min(1, memory.grad_clip / |grad|), |grad| the write's gradient norm
              next chunk             the next chunk's write loss after this write over before it (< 1: the
                                     write predicts the next chunk's associations)
    gates     theta, eta, alpha      learning rate, momentum, decay
    loss      written / unwritten    next-token loss (all positions, last quarter), mean |difference|
    outer     |grad|                 the outer gradient reaching each memory parameter

Prints one line per figure (mean over blocks and chunks, then first and last chunk of the first block).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ttt.layers.neural_memory import NeuralMemory, NeuralMemoryTransformer, memory_mlp


def mean_cosine(vectors: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity of the distinct pairs of vectors (B, T, d), T >= 2, per row: (B,)."""
    unit = F.normalize(vectors.float(), dim=-1)
    count = vectors.shape[1]
    return ((unit @ unit.transpose(1, 2)).sum((1, 2)) - count) / (count * (count - 1))


def _detached(weights: dict) -> dict:
    return {name: w.detach() for name, w in weights.items()}


class MemoryProbe:
    """Figures (name -> one value per memory block and chunk) gathered while `NeuralMemory.read` and
    `write` run inside `probing`."""

    def __init__(self):
        self.figures: dict[str, list[float]] = defaultdict(list)
        self._last_written: dict[int, dict] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self.figures[name].append(value.float().mean().item())

    def after_read(self, memory: NeuralMemory, weights: dict, u: torch.Tensor, read: torch.Tensor) -> None:
        with torch.no_grad():
            queries = F.normalize(memory.wq(u), dim=-1)
            initial = memory.wr(memory_mlp(dict(memory.init.items()), queries))
            size = u.float().norm(dim=-1)
            self.add("read |r| / |h|", read.float().norm(dim=-1) / size)
            self.add(
                "read |r - r_0| / |h| (what the writes add)", (read - initial).float().norm(dim=-1) / size
            )
            if u.shape[1] > 1:
                self.add("queries mean cos", mean_cosine(queries))

    def after_write(self, memory: NeuralMemory, weights: dict, u: torch.Tensor, write) -> None:
        u = u.detach()
        keys, values = (t.detach() for t in memory.write_pairs(u))
        previous = self._last_written.get(id(memory))
        with torch.no_grad():
            if keys.shape[1] > 1:
                self.add("keys mean cos", mean_cosine(keys))
            theta, eta, alpha = memory.gate_values(u)
            for name, gate in (("theta", theta), ("eta", eta), ("alpha", alpha)):
                self.add(f"gate {name}", gate)
            if previous is not None:
                before, after = previous
                self.add(
                    "next chunk: write loss after / before the last write",
                    memory.associative_loss(after, u) / memory.associative_loss(before, u),
                )
        start = {name: w.detach().requires_grad_() for name, w in weights.items()}
        with torch.enable_grad():
            loss = memory.associative_loss(start, u).sum()
            grads = torch.autograd.grad(loss, list(start.values()))
            once, _ = write(
                start, memory.init_state(start), u, lr_scale=1.0, create_graph=False, retain_graph=False
            )
        with torch.no_grad():
            norm = torch.sqrt(sum(g.float().square().flatten(1).sum(-1) for g in grads))
            clip = memory.cfg.grad_clip
            self.add("write |grad|", norm)
            self.add(
                "write clip factor", torch.ones_like(norm) if clip is None else (clip / norm).clamp(max=1)
            )
            error = values - memory_mlp(start, keys)
            moved = memory_mlp(_detached(once), keys) - memory_mlp(start, keys)
            self.add("write <dM, e> / |e|^2 (one write)", (moved * error).sum(-1) / error.square().sum(-1))
            self.add("write |e| / |v|", error.norm(dim=-1) / values.norm(dim=-1))

    def remember(self, memory: NeuralMemory, before: dict, after: dict) -> None:
        self._last_written[id(memory)] = (_detached(before), _detached(after))

    def report(self) -> str:
        """One line per figure: mean, first and last value."""
        lines = []
        for name, values in self.figures.items():
            mean = sum(values) / len(values)
            lines.append(f"{name:56s} mean {mean:9.4g}   first {values[0]:9.4g}   last {values[-1]:9.4g}")
        return "\n".join(lines)


@contextlib.contextmanager
def probing(model: NeuralMemoryTransformer, probe: MemoryProbe) -> Iterator[MemoryProbe]:
    """Within the block, every memory's read and write of `model` also feed `probe` (their results are
    unchanged); the instances' methods are restored on exit."""
    memories = [block.memory for block in model.suffix]
    for memory in memories:
        read, write = memory.read, memory.write

        def probed_read(weights, u, memory=memory, read=read):
            out = read(weights, u)
            probe.after_read(memory, weights, u, out)
            return out

        def probed_write(weights, state, u, memory=memory, write=write, **options):
            new, new_state = write(weights, state, u, **options)
            probe.after_write(memory, weights, u, write)
            probe.remember(memory, weights, new)
            return new, new_state

        memory.read, memory.write = probed_read, probed_write
    try:
        yield probe
    finally:
        for memory in memories:
            del memory.read, memory.write


def diagnose(model: NeuralMemoryTransformer, tokens: torch.Tensor) -> str:
    """The report (module docstring) of `model` on tokens (B, N) int64: one written read with its
    outer backward, one unwritten read."""
    probe = MemoryProbe()
    model.zero_grad(set_to_none=True)
    with probing(model, probe), torch.enable_grad():
        written = model.token_losses(tokens, adapt=True)
        written.mean().backward()
    with torch.no_grad():
        unwritten = model.token_losses(tokens, adapt=False)
    written = written.detach()
    late = slice(3 * written.shape[1] // 4, None)
    lines = [probe.report()]
    lines.append(
        f"{'loss written / unwritten (all positions)':56s} "
        f"{written.mean().item():.4f} / {unwritten.mean().item():.4f}"
    )
    lines.append(
        f"{'loss written / unwritten (last quarter)':56s} "
        f"{written[:, late].mean().item():.4f} / {unwritten[:, late].mean().item():.4f}"
    )
    lines.append(
        f"{'mean |written - unwritten| per token':56s} {(written - unwritten).abs().mean().item():.4f}"
    )
    grads: dict[str, list[float]] = defaultdict(list)
    for name, param in model.named_parameters():
        if ".memory." in name and param.grad is not None:
            grads[name.split(".memory.", 1)[1]].append(param.grad.float().norm().item())
    lines.append("outer |grad| per memory parameter (one value per memory block):")
    lines += [f"  {name:24s} " + "  ".join(f"{g:.3e}" for g in values) for name, values in grads.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ttt.experiments.neural_memory_diagnose`; returns the exit status."""
    from recipes import load_builder
    from ttt.config import ConfigError
    from ttt.tracking import load_checkpoint
    from ttt.train import prepare

    parser = argparse.ArgumentParser(
        prog="python -m ttt.experiments.neural_memory_diagnose",
        description=__doc__.splitlines()[0],
        epilog="recipe=NAME or run=RUN_DIR, then config overrides as for python -m ttt.train",
    )
    parser.add_argument("--rows", type=int, default=4, help="test windows read side by side (default 4)")
    args, overrides = parser.parse_known_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be a positive int, got {args.rows}")
    overrides = [f"resume={o.split('=', 1)[1]}" if o.startswith("run=") else o for o in overrides]
    try:
        cfg, _, checkpoint = prepare(overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.manual_seed(cfg.seed)
    learner, data = load_builder(cfg.builder).build(cfg)
    if checkpoint is not None:
        learner.load_state_dict(load_checkpoint(checkpoint)["state_dict"])
    if not isinstance(learner.model, NeuralMemoryTransformer):
        print(f"error: recipe {cfg.recipe} has no neural memory (builder {cfg.builder})", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = learner.model.to(device).train()
    data.setup("test")
    tokens = next(iter(data.test_dataloader()))["tokens"][: args.rows].to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled="bf16" in str(cfg.trainer.precision))
    with autocast:
        print(
            f"{cfg.recipe}, {'checkpoint ' + str(checkpoint) if checkpoint else 'at initialisation'}, "
            f"{tokens.shape[0]} test windows of {tokens.shape[1]} tokens"
        )
        print(diagnose(model, tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
