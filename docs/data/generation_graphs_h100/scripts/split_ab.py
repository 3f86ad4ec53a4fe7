"""The split forward's A/B at decoding shapes, as measured for docs/notes/kernel_notes.md (`b837a0e`).

    OUT=dir python docs/data/generation_graphs_h100/scripts/split_ab.py

Each case's forward device time per call (50 calls captured in one CUDA graph, replayed 20 times, 5
rounds: median, min, max) with the plain kernel (`force_splits(1)`) and by the rule, each output's
largest difference from the float64 torch backend; then ttt_e2e_125m's graphed decode tokens/s after
8K, plain and split, two rounds. Rows to $OUT/split_ab.jsonl.
"""

import contextlib
import json
import os
import time

import torch

import flashbob
from flashbob.tiling import force_splits
from ttt.experiments.generation import build_model, prompt
from ttt.layers.generation import prefill
from ttt.layers.graphed import GraphedDecoder

CASES = [(12, 12, 64, 1, 8192, 8192), (32, 8, 64, 1, 8192, 8192), (12, 12, 64, 1, 131072, None),
         (32, 8, 64, 1, 131072, None), (12, 12, 128, 4, 8192, None), (12, 12, 64, 16, 8192, 8192)]
"""(Hq, Hkv, head dim, N, M, window)."""
PATHS = {"plain": lambda: force_splits(1), "rule": contextlib.nullcontext}


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ["OUT"], "split_ab.jsonl"), "a") as out:
        out.write(json.dumps(row) + "\n")


def graphed_us(fn, calls: int = 50, replays: int = 20, rounds: int = 5) -> list[float]:
    """[median, min, max] over rounds of fn's device time per call, in microseconds."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays / calls)
    return [round(sorted(times)[rounds // 2], 2), round(min(times), 2), round(max(times), 2)]


def kernel_case(hq: int, hkv: int, d: int, n: int, m: int, window: int | None) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, hkv, m, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    want = flashbob.flash_attention(q.double(), k.double(), v.double(), causal=True, window=window,
                                    backend="torch")  # fmt: skip
    row = {"hq": hq, "hkv": hkv, "d": d, "n": n, "m": m, "window": window}
    for name, path in PATHS.items():
        with torch.no_grad(), path():
            def call():
                return flashbob.flash_attention(q, k, v, causal=True, window=window)

            row[f"err_{name}"] = (call().double() - want).abs().max().item()
            row[f"{name}_us"] = graphed_us(call)
    row["speedup"] = row["plain_us"][0] / row["rule_us"][0]
    return row


def decode_rate(model, path, tokens: int = 600) -> float:
    """Graphed decode tokens/s after an 8K prompt, the decoder captured under `path`."""
    with path():
        state, logits = prefill(model, prompt(8192, model.cfg.vocab_size, torch.device("cuda")), graphs=True)
        decoder, token = GraphedDecoder(state), logits[:, -1].argmax(-1)
        for _ in range(3):
            token = decoder(token).argmax(-1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(tokens):
            token = decoder(token).argmax(-1)
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    for case in CASES:
        emit(kernel_case(*case))
    model = build_model(["recipe=ttt_e2e_125m"], torch.bfloat16, torch.device("cuda"))
    for round_ in range(2):
        for name, path in PATHS.items():
            emit({"decode": name, "round": round_, "tokens_per_s": decode_rate(model, path)})


if __name__ == "__main__":
    main()
