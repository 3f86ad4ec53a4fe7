"""Continue a prompt with the model of a TTT-E2E run, streaming the text: the command line and its Python API.

    python -m ttt.generate RUN_DIR --prompt FILE --max-new-tokens N [--temperature T] [--top-p P]
        [--seed S] [--device D] [--no-ttt] [--graphs auto|on|off]

    from ttt.generate import TextGenerator
    generator = TextGenerator.load("runs/ttt_e2e-20260101-120000-000000", device="cuda")
    for piece in generator.stream("def parse(", 200, temperature=0.8, top_p=0.95, seed=1):
        print(piece, end="", flush=True)

RUN_DIR is a run directory of ttt.train (or one of its checkpoint files) whose model is a
`TTTTransformer` (recipes ttt_e2e*, and the pretrained ones with a converted checkpoint); it is loaded
with `ttt.load`. The prompt, UTF-8 text, is tokenized with the run's tokenizer (data.tokenizer), after
the BOS token that began every training document under data.packing=stream. The model reads it chunk by
chunk with its inner steps (first order, no outer graph; inner learning rates at the run's last step, as
its evaluation read), then decodes token by token with its key/value caches, taking the inner steps of
each chunk once its last target is drawn (`ttt.layers.generation`). Tokens are greedy at temperature 0
(the default), else drawn from the softmax at that temperature within the top-p nucleus, seeded.
Generation stops after N tokens, or at the BOS token (the end of a document) under data.packing=stream.
The text goes to stdout as it is decoded; a progress bar of the prompt's reading goes to stderr when
stderr is a terminal or the prompt is long (LONG_PROMPT_CHUNKS chunks or more). On a CUDA device a
sliding-window model reads the prompt's chunks and decodes each token as CUDA graphs (`--graphs auto`,
the default; `ttt.layers.graphed`: the same results, about 5x faster prefill and 9x faster decoding of
ttt_e2e_125m on an H100 at `64a297c`, docs/generation.md); --graphs off runs the eager code.

Exit status 2, with a message naming what is wrong: a run directory without a checkpoint (or not a
run's), a tokenizer whose vocabulary does not fit the model's, a model that is not a TTT-E2E one, a
prompt file that is not UTF-8 text or is empty, --max-new-tokens < 1, --temperature < 0, --top-p not in
(0, 1], a device that is not there, --graphs on for a model without a sliding window.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from recipes.ttt_e2e import stream_bos
from ttt.config import ConfigError
from ttt.layers import TTTTransformer
from ttt.layers.generation import check_sampling, generate
from ttt.meta.loading import load
from ttt.text.corpus import Packing
from ttt.text.tokenizer import TextStream, Tokenizer
from ttt.tracking import CheckpointError

LONG_PROMPT_CHUNKS = 16
"""A prompt of this many chunks (ttt.chunk_len tokens each) or more shows its progress bar on any stderr."""

FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p"}
"""The command-line flag of each argument of `check_sampling`, for its messages."""


@dataclass
class TextGenerator:
    """A run's TTT-E2E model with its tokenizer, continuing prompts (module docstring)."""

    model: TTTTransformer
    tokenizer: Tokenizer
    lr_scale: float
    """Factor on the inner learning rates: the run's at its last step (1.0 after the warm-up)."""
    bos: int | None
    """The token before every training document (data.packing=stream): put before the prompt, left out
    of the inner loss as a target, and the end of a generation; None for windows cut from documents."""

    @classmethod
    def load(cls, run: str | Path, *, device: str | torch.device = "cpu") -> TextGenerator:
        """The model and tokenizer of the run directory (or checkpoint file) `run`, on `device`. Raises
        `ttt.load`'s errors, and ValueError when the run's model is not a `TTTTransformer`."""
        learner, cfg = load(run, device=device)
        model = getattr(learner, "model", None)
        if not isinstance(model, TTTTransformer):
            raise ValueError(
                f"{run}: generation runs a TTT-E2E model (a TTTTransformer: recipes ttt_e2e*, pretrained/* "
                f"with model.checkpoint); recipe {cfg.recipe} has a {type(model or learner).__name__}"
            )
        tokenizer = learner.tokenizer
        bos = stream_bos(cfg.data, tokenizer) if cfg.data.packing == Packing.stream else None
        return cls(model, tokenizer, learner.inner_lr_scale(), bos)

    def encode(self, prompt: str) -> torch.Tensor:
        """The prompt's tokens (1, P) int64 on the model's device, after `bos` where there is one;
        ValueError for a prompt without tokens."""
        ids = [*([] if self.bos is None else [self.bos]), *self.tokenizer.encode(prompt).tolist()]
        if not ids:
            raise ValueError("the prompt is empty: nothing to continue")
        return torch.tensor([ids], dtype=torch.long, device=self.model.embed.weight.device)

    def stream(
        self,
        prompt: str,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        adapt: bool = True,
        on_chunk: Callable[[int], None] | None = None,
        graphs: bool = False,
    ) -> Iterator[str]:
        """The continuation of `prompt`, piece by piece as it is decoded (`TextStream`): up to
        max_new_tokens tokens, stopping at `bos`. temperature, top_p, seed, on_chunk: as in
        `ttt.layers.generation.generate`; adapt=False reads without the inner steps; graphs: CUDA graphs
        of the prompt's chunks and of each token (`ttt.layers.graphed`; sliding-window models)."""
        tokens = self.encode(prompt)
        drawn = generate(
            self.model, tokens, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
            adapt=None if adapt else False, lr_scale=self.lr_scale, masked_target=self.bos,
            stop_token=self.bos, on_chunk=on_chunk, graphs=graphs,
        )  # fmt: skip
        text = TextStream(self.tokenizer)
        for token in drawn:
            if int(token[0]) == self.bos:
                break
            piece = text.push(int(token[0]))
            if piece:
                yield piece
        rest = text.finish()
        if rest:
            yield rest


def read_prompt(path: Path) -> str:
    """The text of the prompt file; ValueError naming --prompt when it cannot be read, is not UTF-8 text
    (or holds a NUL byte) or is empty."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"--prompt {path}: cannot be read ({err.strerror})") from err
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--prompt {path} is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})"
        ) from err
    if "\x00" in text:
        raise ValueError(f"--prompt {path} is not text (a NUL byte at offset {text.index(chr(0))})")
    if not text:
        raise ValueError(f"--prompt {path} is empty: nothing to continue")
    return text


def check_device(name: str) -> torch.device:
    """The device `name`; ValueError naming --device when it is not one or is not there."""
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise ValueError(f"--device {name!r} is not available here ({str(err).splitlines()[0]})") from err
    return device


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ttt.generate`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m ttt.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", type=Path, help="run directory of ttt.train (or one of its checkpoint files)")
    parser.add_argument("--prompt", type=Path, required=True, help="UTF-8 text file to continue")
    parser.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate at most (>= 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampling, in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")
    parser.add_argument("--no-ttt", action="store_true", help="read without the inner steps")
    parser.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                        help="CUDA graphs of the prompt's chunks and of each token (ttt.layers.graphed); "
                        "auto (default): on a CUDA device for a sliding-window model")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        check_sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    except ValueError as err:
        message = str(err)
        for name, flag in FLAGS.items():
            message = message.replace(name, flag)
        parser.error(message)
    try:
        prompt = read_prompt(args.prompt)
        generator = TextGenerator.load(args.run, device=check_device(args.device))
        tokens = generator.encode(prompt).shape[1]
        windowed = generator.model.cfg.window is not None
        if args.graphs == "on" and not windowed:
            raise ValueError("--graphs on needs a sliding-window model (model.window set); this run's "
                             "model attends to every key")  # fmt: skip
        graphs = args.graphs == "on" or (args.graphs == "auto" and windowed and "cuda" in args.device)
    except (FileNotFoundError, CheckpointError, ConfigError, LookupError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    chunk_len = generator.model.ttt_cfg.chunk_len
    show = sys.stderr.isatty() or tokens >= LONG_PROMPT_CHUNKS * chunk_len
    bar = tqdm(total=tokens, desc="reading the prompt", unit="tok", disable=not show, leave=False)

    def on_chunk(positions: int) -> None:
        bar.update(positions)
        if bar.n == tokens:  # the prompt is read: the text follows
            bar.close()

    pieces = generator.stream(
        prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        adapt=not args.no_ttt, on_chunk=on_chunk, graphs=graphs,
    )  # fmt: skip
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
