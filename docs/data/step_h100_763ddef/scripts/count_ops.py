# ruff: noqa  (the script as it ran, kept as a record)
"""Aten ops of a tiny 1B-shaped (GQA, window, segments) second-order scale run on the CPU, by op name."""
import collections, json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from ttt.experiments import scale

class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.ops = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

args = ["recipe=pretrained/llama3_2_1b", "model.architecture.vocab_size=512", "model.architecture.d_model=64",
        "model.architecture.n_layers=4", "model.architecture.n_heads=4", "model.architecture.n_kv_heads=2",
        "model.architecture.d_ff=128", "model.architecture.window=64", "ttt.suffix_len=2", "ttt.chunk_len=16",
        "data.seq_len=512", "ttt.checkpoint_segment=8", "trainer.meta_batch_size=1", "model.architecture.attention=eager",
        *sys.argv[2:]]
with Count() as c:
    scale.main([*args, "--steps", "1", "--modes", "second"])
top = c.ops.most_common(25)
print(json.dumps({"total": sum(c.ops.values()), "top": top}))
json.dump(dict(c.ops), open(sys.argv[1], "w"))
