"""`CompiledOnCuda`'s compiled path: each variant of the arguments (dtypes, ranks, flags) compiles from its
own code, so that no number of variants reaches torch.compile's recompile limit and runs uncompiled."""

import torch

from ttt.models.compiled import CompiledOnCuda


def scaled(x, w, flip):
    """A stand-in for the fused ops' math: (x * w) in x's dtype, negated with flip."""
    out = x.float() * w.float()
    return (-out if flip else out).to(x.dtype)


def test_every_variant_is_compiled_and_a_new_row_count_is_not(monkeypatch):
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=counting, **options))
    op = CompiledOnCuda(scaled, "test", dynamic_rows=True)
    variants = [
        (torch.float32, 2, False), (torch.float32, 2, True), (torch.float64, 2, False),
        (torch.bfloat16, 2, False), (torch.float32, 3, False), (torch.float64, 3, True),
    ]  # fmt: skip
    with torch._dynamo.config.patch(recompile_limit=2):
        for dtype, rank, flip in variants:
            for rows in (5, 9):  # the second row count reuses the first's code (dynamic rows)
                x = torch.randn(*(3,) * (rank - 2), rows, 8).to(dtype)
                w = torch.randn(8)
                expected = scaled(x, w, flip)
                torch.testing.assert_close(op.compiled(x, w, flip), expected, rtol=0, atol=0)
    assert len(graphs) == len(variants)  # one compilation each: none ran uncompiled, none recompiled
