# session 7: where the GPU time of a decoded token and of a prefill chunk goes (eager code, kernels sorted by
# device time), ttt_e2e_125m bf16; the graphed runs replay the same kernels
import json, os, time, torch
from torch.profiler import profile, ProfilerActivity
from ttt.experiments.generation import build_model, prompt
from ttt.layers.generation import prefill, decode_step
dev = torch.device("cuda")
out = open(os.environ["OUT"] + "/profile_dev.jsonl", "a")
model = build_model(["recipe=ttt_e2e_125m"], torch.bfloat16, dev)
state, logits = prefill(model, prompt(9216, model.cfg.vocab_size, dev))
tok = logits[:, -1].argmax(-1)
for _ in range(10): tok = decode_step(state, tok).argmax(-1)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(10): tok = decode_step(state, tok).argmax(-1)
    torch.cuda.synchronize()
print("decode, 10 tokens after 9216"); print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60), flush=True)
toks = prompt(10241, model.cfg.vocab_size, dev)
prefill(model, toks); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    prefill(model, toks); torch.cuda.synchronize()
print("prefill 10241 (10 chunks, 2 with full caches)"); print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60), flush=True)
