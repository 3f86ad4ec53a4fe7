"""Where the GPU time of a decoded token and of a prefill goes, as quoted on docs/generation.md: the
eager code (the graphed runs replay the same kernels), ttt_e2e_125m in bf16, kernels sorted by device
time. `python docs/data/generation_graphs_h100/scripts/profile_dev.py` on a GPU."""

import torch
from torch.profiler import ProfilerActivity, profile

from ttt.experiments.generation import build_model, prompt
from ttt.layers.generation import decode_step, prefill


def table(run) -> str:
    """The kernels of one run() under the profiler, by device time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60)


def main() -> None:
    device = torch.device("cuda")
    model = build_model(["recipe=ttt_e2e_125m"], torch.bfloat16, device)
    state, logits = prefill(model, prompt(9216, model.cfg.vocab_size, device))
    token = logits[:, -1].argmax(-1)

    def decode(tokens: int = 10) -> None:
        nonlocal token
        for _ in range(tokens):
            token = decode_step(state, token).argmax(-1)

    decode()
    print("decode, 10 tokens after 9216\n" + table(decode), flush=True)
    tokens = prompt(10241, model.cfg.vocab_size, device)
    prefill(model, tokens)
    print("prefill of 10241 tokens (the prefix pass, 10 chunks)\n" + table(lambda: prefill(model, tokens)))


if __name__ == "__main__":
    main()
