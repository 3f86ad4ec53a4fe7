# session 7: the split-keys forward (flash-decoding) A/B in one process: each decode-shaped forward's device time
# (50 calls captured in one CUDA graph, replayed) with the plain kernel (force_splits(1)) and by the rule, and the
# largest difference between the two outputs; then ttt_e2e_125m's graphed decode tokens/s, plain and split
import contextlib, json, os, time, torch, flashbob
from flashbob.tiling import force_splits
out = open(os.environ["OUT"] + "/split_ab.jsonl", "a")
def emit(row): print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()
def graphed_ms(fn, calls=50, replays=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls): fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        a.record(); [g.replay() for _ in range(replays)]; b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / replays / calls)
    return sorted(times)[2], min(times), max(times)
dev = torch.device("cuda")
for hq, hkv, d, n, m, window in [(12, 12, 64, 1, 8192, 8192), (32, 8, 64, 1, 8192, 8192), (12, 12, 64, 1, 131072, None),
                                  (32, 8, 64, 1, 131072, None), (12, 12, 128, 4, 8192, None), (12, 12, 64, 16, 8192, 8192)]:
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, hq, n, d, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, hkv, m, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    row = {"hq": hq, "hkv": hkv, "d": d, "n": n, "m": m, "window": window}
    res = {}
    for name, ctx in [("plain", lambda: force_splits(1)), ("rule", contextlib.nullcontext)]:
        with torch.no_grad(), ctx():
            fn = lambda: flashbob.flash_attention(q, k, v, causal=True, window=window)
            res[name] = fn().float()
            row[name + "_us"] = [round(t * 1e3, 2) for t in graphed_ms(fn)]
    ref = flashbob.flash_attention(q.double(), k.double(), v.double(), causal=True, window=window, backend="torch")
    row["err_plain"] = (res["plain"] - ref).abs().max().item(); row["err_rule"] = (res["rule"] - ref).abs().max().item()
    row["speedup"] = row["plain_us"][0] / row["rule_us"][0]
    emit(row)
from ttt.experiments.generation import build_model, prompt
from ttt.layers.generation import prefill
from ttt.layers.graphed import GraphedDecoder
model = build_model(["recipe=ttt_e2e_125m"], torch.bfloat16, dev)
for rnd in range(2):
    for name, ctx in [("plain", lambda: force_splits(1)), ("rule", contextlib.nullcontext)]:
        with ctx():
            state, logits = prefill(model, prompt(8192, model.cfg.vocab_size, dev), graphs=True)
            dec = GraphedDecoder(state); tok = logits[:, -1].argmax(-1)
            for _ in range(3): tok = dec(tok).argmax(-1)
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(600): tok = dec(tok).argmax(-1)
            torch.cuda.synchronize(); emit({"decode": name, "round": rnd, "tokens_per_s": 600 / (time.perf_counter() - t)})
        del state, dec
