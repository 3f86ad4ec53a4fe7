"""Time and peak memory of one Hessian-vector product through a whole Transformer as context grows,
as a multiple of one gradient, per attention backend; where each backend runs out of memory.

    python benchmarks/hvp_context.py                 # one H200: about 2-3 minutes
    python benchmarks/hvp_context.py --device cpu --contexts 64,128 --n-layers 1 --d-model 64 \
        --n-heads 2 --n-kv-heads 1 --d-ff 128 --vocab 256 --dtype fp32   # the logic, on a CPU

Default model: SmolLM2-135M's block shape (d_model 576, 9 query / 3 key-value heads of width 64,
SwiGLU width 1536, tied embeddings) with 4 of its 30 blocks and a vocabulary of 8192, in bf16, on
one sequence of 4K-64K random tokens (pass --n-layers 30 --vocab 49152 for the whole model's shape).
The loss is the mean next-token cross-entropy; the HVP is over every parameter
(`ttt.second_order.measure_hvp`). Writes results.json (meta and rows) and table.md under --out and
prints the table. A backend that runs out of memory at N is not run at longer contexts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kernels.environment import describe
from ttt.models import ATTENTION_BACKENDS, Transformer, TransformerConfig
from ttt.second_order.measure import sweep_contexts

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,8192,16384,32768,65536", help="comma-separated token counts")
    p.add_argument(
        "--backends", default=",".join(ATTENTION_BACKENDS), help="comma-separated attention backends"
    )
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--d-model", type=int, default=576)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=9)
    p.add_argument("--n-kv-heads", type=int, default=3)
    p.add_argument("--d-ff", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement, after one warm-up")
    p.add_argument("--out", default="runs/hvp_context", help="output directory")
    args = p.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.backends = [x for x in args.backends.split(",") if x]
    unknown = sorted(set(args.backends) - set(ATTENTION_BACKENDS))
    if unknown:
        p.error(f"--backends: unknown {unknown}; choose from {', '.join(ATTENTION_BACKENDS)}")
    if not args.contexts or min(args.contexts) < 2:
        p.error(f"--contexts must be token counts >= 2, got {args.contexts}")
    return args


def cell(value, spec: str) -> str:
    """A table cell: the formatted number, or a dash when it was not measured."""
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    """One line per (N, backend): seconds and peak GiB of a gradient and of an HVP, and their ratios."""
    lines = [
        f"HVP vs gradient, {meta['model']}, {meta['dtype']}, batch {meta['batch']}; "
        f"{meta['env']['device']}, commit {meta['env']['commit']}",
        f"`{meta['env']['command']}`",
        "",
        "| N | backend | runs | status | grad s | HVP s | HVP / grad time "
        "| grad peak GiB | HVP peak GiB | HVP / grad peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        status = row["status"] if not row.get("error") else f"{row['status']} ({row['error'][:60]})"
        lines.append(
            f"| {row['n_tokens']} | {row['backend']} | {row.get('executes', '-')} | {status} | "
            f"{cell(row.get('grad_s'), '.3f')} | "
            f"{cell(row.get('hvp_s'), '.3f')} | {cell(row.get('hvp_over_grad_s'), '.2f')} | "
            f"{cell(row.get('grad_peak_gib'), '.2f')} | {cell(row.get('hvp_peak_gib'), '.2f')} | "
            f"{cell(row.get('hvp_over_grad_peak'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the sweep, write results.json and table.md under --out, print the table; returns the rows."""
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = TransformerConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        d_ff=args.d_ff,
        tie_embeddings=True,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=DTYPES[args.dtype])
    env = describe(device, "benchmarks/hvp_context.py", argv)
    meta = {
        "env": env,
        "model": f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, "
        f"d_ff {cfg.d_ff}, vocab {cfg.vocab_size}",
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "batch": args.batch,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(json.dumps(row), flush=True)

    sweep_contexts(model, args.contexts, args.backends, batch=args.batch, repeats=args.repeats, on_row=record)
    table = markdown(rows, meta)
    (out / "table.md").write_text(table)
    print(table)
    return rows


if __name__ == "__main__":
    main()
