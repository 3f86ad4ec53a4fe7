"""Run by test_launch_plans.py in a process of its own (without TRITON_INTERPRET: the kernels compile
for sm_90 and a stand-in driver launches nothing, `flashbob.bench.host.stand_in_gpu`). For each case
in argv[1] (JSON), prints one JSON line: the arguments each launch handed the driver when the
launcher replayed its plan and when the same call ran as written, each tensor named by the slot it
is (inputs and outputs) or as the call's n-th scratch buffer; how many launches went through
Triton's JITFunction.run in the replayed call; and the kind of each launch in the plan."""

import json
import sys

import torch
from triton.runtime.jit import JITFunction

from flashbob import launch_plans, triton_ops
from flashbob.bench.host import plans, stand_in_gpu

jit_runs = 0
_run = JITFunction.run


def counted_run(self, *args, **kwargs):
    global jit_runs
    jit_runs += 1
    return _run(self, *args, **kwargs)


JITFunction.run = counted_run


def inputs(case: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, n, d = case["b"], case["hq"], case["hkv"], case["n"], case["d"]
    m = case.get("m", n)
    dtype = getattr(torch, case.get("dtype", "bfloat16"))

    def rand(heads, rows=n):
        return torch.randn(b, heads, rows, d, generator=gen).to(dtype)

    t = dict(q=rand(hq), k=rand(hkv, m), v=rand(hkv, m), out=rand(hq), dout=rand(hq), dq=rand(hq),
             u_q=rand(hq), u_k=rand(hkv, m), u_v=rand(hkv, m), lse=torch.randn(b, hq, n, generator=gen))
    for name in case.get("absent", ()):
        t[name] = None
    t["key_range"] = torch.tensor([[1, m]] * b, dtype=torch.int32) if case.get("key_range") else None
    return t


def call(case: dict, t: dict):
    opts = dict(causal=case["causal"], window=case.get("window"), scale=0.3, key_range=t["key_range"])
    stage = case["stage"]
    if stage == "forward":
        return triton_ops.forward(t["q"], t["k"], t["v"], **opts)
    if stage == "backward":
        return triton_ops.backward(t["q"], t["k"], t["v"], t["out"], t["lse"], t["dout"], **opts)
    if stage == "jvp":
        return triton_ops.jvp(t["q"], t["k"], t["v"], t["u_q"], t["u_k"], t["u_v"], **opts)
    return triton_ops.bob(t["q"], t["k"], t["v"], t["out"], t["lse"], t["dout"], t["dq"], t["u_q"], t["u_k"],
                          t["u_v"], **opts)


def canonical(launches: list, t: dict, outputs) -> list:
    names = {v.data_ptr(): k for k, v in t.items() if isinstance(v, torch.Tensor)}
    names.update({o.data_ptr(): f"output{i}" for i, o in enumerate(outputs)})
    scratch: dict[int, str] = {}

    def name(ptr: int) -> str:
        return names.get(ptr) or scratch.setdefault(ptr, f"scratch{len(scratch)}")

    def named(a):
        if isinstance(a, torch.Tensor):
            return ["tensor", name(a.data_ptr()), list(a.shape), list(a.stride()), str(a.dtype)]
        if isinstance(a, tuple) and a and a[0] == "tma":
            return ["tma", name(a[1]), repr(a[2:])]
        if isinstance(a, (tuple, list)):   # newer Tritons hand the kernel's arguments over as one tuple
            return [named(x) for x in a]
        if a is None or type(a).__name__ in ("LazyDict", "HookChain"):
            return "-"   # launch metadata and hooks: none are set, so none are called
        return repr(a)

    return [[named(a) for a in args] for args in launches]


def main():
    global jit_runs
    for case in json.loads(sys.argv[1]):
        seen: list = []
        with stand_in_gpu(launch_to=seen.append):   # starts with no plans
            with plans(True):
                call(case, inputs(case, 0))          # records
                t = inputs(case, 1)
                seen.clear()
                jit_runs = 0
                replayed = canonical(seen, t, call(case, t))
                replay_jit_runs = jit_runs
            with plans(False):
                seen.clear()
                written = canonical(seen, t, call(case, t))
            kinds = [type(launch).__name__ for plan in launch_plans._plans.values()
                     for launch in plan.launches]
            count = launch_plans.count()
        print(json.dumps(dict(case=case, replayed=replayed, written=written, plans=count,
                              replay_jit_runs=replay_jit_runs, launch_kinds=kinds)), flush=True)


if __name__ == "__main__":
    main()
