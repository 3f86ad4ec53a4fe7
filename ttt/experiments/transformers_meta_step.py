"""One second-order meta step of a transformers model: attn_implementation "bob" vs "eager" vs "sdpa".

The model is transformers' own LlamaForCausalLM in the shape of SmolLM2-135M (30 layers, d 576,
9 query / 3 key-value heads of 64, vocab 49152, tied embeddings), random weights made on the machine
(no download), in bf16. The step (`ttt.inner.meta_step`, measured by
`ttt.experiments.meta_step_probe.measure`): k inner SGD steps on one sequence's next-token loss over
the adapted MLPs (create_graph: second order), the next-token loss of a second sequence with the
adapted weights, and its backward into every parameter. Out-of-memory is recorded as "oom", any
other failure as "error" with its message (SDPA's fused backward has no derivative of its own).

    python -m ttt.experiments.transformers_meta_step                         # H200: about 2 minutes
    python -m ttt.experiments.transformers_meta_step --out docs/data/transformers_meta_step.json
    python -m ttt.experiments.transformers_meta_step --tiny --device cpu     # logic check, seconds
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from flashbob.environment import describe
from ttt.experiments.meta_step_probe import measure
from ttt.experiments.workloads import NextTokenObjective, Point, random_task
from ttt.inner import InnerLoop, InnerLoopConfig, meta_step, select_parameters
from ttt.models.hf_causal_lm import build_causal_lm

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""--dtype -> the dtype name `build_causal_lm` takes."""


def smollm2_135m_config(tiny: bool = False):
    """transformers LlamaConfig of SmolLM2-135M's architecture (tiny: 2 layers of d 64, for CPU checks)."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        )  # fmt: skip
    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, max_position_embeddings=16384,
    )  # fmt: skip


@dataclass
class HFSetup:
    """What stays fixed over the benchmark's points."""

    config: object
    """The transformers config of the model."""
    adapted: list[str]
    """Glob patterns (transformers names) of the inner-loop parameters."""
    inner_lr: float
    device: torch.device
    dtype: str
    """float32, bfloat16 or float16."""
    seed: int


def build_hf_step(setup: HFSetup, point: Point):
    """(model, step) of `point`: point.backend is the attn_implementation, point.n the tokens."""
    torch.manual_seed(setup.seed)
    model = build_causal_lm(setup.config, point.backend, setup.dtype).to(setup.device)
    params = select_parameters(model, setup.adapted)
    inner = InnerLoop(params, InnerLoopConfig(params=list(setup.adapted), steps=point.k, lr=setup.inner_lr))
    task = random_task(point.n, setup.config.vocab_size, setup.device, setup.seed)
    objective = NextTokenObjective(model)

    def step() -> None:
        meta_step(objective, inner, params, [task])

    return model, step


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=int, nargs="+", default=[2048, 4096, 16384], help="sequence lengths")
    p.add_argument("--attn", nargs="+", default=["bob", "eager", "sdpa"], help="attn_implementations")
    p.add_argument("--k", type=int, default=1, help="inner SGD steps")
    p.add_argument("--adapted", nargs="+", default=["model.layers.2[6-9].mlp.*"], help="inner-loop params")
    p.add_argument("--inner-lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU logic check)")
    p.add_argument("--out", help="also write the rows and the environment to this JSON file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    setup = HFSetup(
        smollm2_135m_config(args.tiny), args.adapted, args.inner_lr, device, DTYPES[args.dtype], seed=0
    )
    if args.tiny:
        setup.adapted = ["model.layers.1.mlp.*"]
    rows = []
    for attn in args.attn:
        failed_at = None
        for i, n in enumerate(sorted(args.ns)):
            point = Point(backend=attn, n=n, k=args.k, order="second", checkpoint=False)
            if failed_at is not None:
                row = {"status": "skipped", "error": f"oom at N={failed_at}"}
            else:
                row = measure(setup, point, warmup=i == 0, builder=build_hf_step)
                if row["status"] == "oom":
                    failed_at = n
            row = {"attn_implementation": attn, "n": n, "k": args.k, **row}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            environment = describe(device, "ttt/experiments/transformers_meta_step.py")
            json.dump({"environment": environment, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
