"""The forward with its keys split over more programs (flash-decoding: `tiling.key_splits`, the split
and combine kernels of `flashbob._forward`) against float64, outputs and scratch poisoned: out and lse
for a few query rows over many keys, with GQA, causal and full masks, windows shorter and longer than
M, key ranges (a batch row without keys, rows without keys under a window), split counts from 1 to
more than the key tiles and the rule's own; the gradients through `flashbob.flash_attention` after a
split forward; and the rule. Launch plans of the split path: test_launch_plans.py."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from kernel_cases import DEVICE, Case, make_inputs, rel_err
from test_key_ranges import RangeCase, explicit_mask, masked_attention, meta_loss

import flashbob
from flashbob import tiling, triton_ops

TOL = 1e-5
"""Relative error of out and the gradients, absolute error of lse: float32 products (IEEE) and sums
over at most 1000 keys, against float64 (the plain forward meets 2e-5 in the other kernel tests)."""


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)


@dataclasses.dataclass(frozen=True)
class SplitCase:
    case: Case
    splits: int | None
    """The count forced by `tiling.force_splits`; None: the rule's own (which must split)."""
    ranges: tuple[tuple[int, int], ...] | None = None
    """(key_start, key_end) per batch row, or None (every key)."""
    empty_rows: bool = False
    """Whether some rows see no key."""

    @property
    def id(self) -> str:
        ranges = "" if self.ranges is None else "-ranges" + "_".join(f"{s}:{e}" for s, e in self.ranges)
        return f"{self.case.id}-splits{self.splits or 'rule'}{ranges}"

    def range_case(self) -> RangeCase:
        """The case as test_key_ranges builds its masks (every key of every batch row without ranges)."""
        ranges = self.ranges or ((0, self.case.m),) * self.case.batch
        return RangeCase(self.case, *map(tuple, zip(*ranges)), "split")

    def options(self) -> dict:
        opts = dict(causal=self.case.causal, window=self.case.window, backend="triton", fp32_precision="ieee")
        if self.ranges is not None:
            opts.update(self.range_case().ranges())
        return opts

    def forced(self):
        return contextlib.nullcontext() if self.splits is None else tiling.force_splits(self.splits)


CASES = [
    # The rule's own split (3 pieces of 1000 keys for 6 heads on the interpreter's 16 SMs); GQA.
    SplitCase(Case(1, 6, 2, 1, 1000, 48), None),
    # A window shorter than M shrinks what the rule splits: 615 keys, 2 pieces.
    SplitCase(Case(1, 2, 2, 16, 1000, 64, causal=True, window=600), None),
    SplitCase(Case(1, 6, 2, 3, 1000, 80, causal=True), 2),
    # More splits than key tiles: the window's 24 keys are 2 tiles, the last splits empty.
    SplitCase(Case(1, 2, 2, 16, 63, 64, causal=True, window=9), 5),
    # A window longer than M; 40 splits (32 of them not empty), more than the combine merges per step.
    SplitCase(Case(1, 6, 2, 3, 1000, 48, causal=True, window=1500), 40),
    # More splits than tiles on M = 37 (3 tiles).
    SplitCase(Case(1, 2, 2, 1, 37, 48), 20),
    # Key ranges: a short one in a single split, and an empty one (out 0, lse -inf).
    SplitCase(Case(3, 4, 2, 1, 300, 80, causal=True), 5, ((0, 300), (120, 140), (50, 50)), empty_rows=True),
    # Left padding under a window: the first rows of batch row 0 see no key.
    SplitCase(Case(2, 2, 2, 16, 300, 80, causal=True, window=5), 5, ((290, 300), (0, 300)), empty_rows=True),
    # Forced on more rows than one block: each row block splits its own causal range.
    SplitCase(Case(1, 2, 1, 37, 63, 48, causal=True), 2),
    # One split: the plain kernel. A range inside the last tiles; no mask otherwise.
    SplitCase(Case(2, 2, 1, 3, 300, 48), 1, ((0, 300), (250, 300))),
]
PARAMS = [pytest.param(sc, id=sc.id) for sc in CASES]
GRADIENT_PARAMS = [PARAMS[0], PARAMS[3], PARAMS[6]]   # the rule's; more splits than tiles; an empty range


class SplitSpy:
    """Stands in for the split kernel: launches it, recording each launch's split count (grid[1])."""

    def __init__(self, kernel):
        self.kernel, self.splits = kernel, []

    def __getitem__(self, grid):
        self.splits.append(grid[1])
        return self.kernel[grid]

    def __getattr__(self, name):  # signature, arg_names (what a launch plan records): the kernel's
        return getattr(self.kernel, name)


@pytest.fixture
def spy(monkeypatch):
    spy = SplitSpy(triton_ops.attention_forward_split_kernel)
    monkeypatch.setattr(triton_ops, "attention_forward_split_kernel", spy)
    return spy


def expected_launches(sc: SplitCase, q, k) -> list[int]:
    """The split counts of the split kernel's launches: none where one split is forced (the plain
    kernel), else the forced count or the rule's (which must split)."""
    if sc.splits is not None:
        return [sc.splits] if sc.splits > 1 else []
    rule = tiling.key_splits(q, k, sc.case.window)
    assert rule > 1, "a case for the rule must split"
    return [rule]


def reference_lse(q, k, mask, scale):
    """Row log-sum-exp of the masked scores in float64: -inf on rows that see no key."""
    group = q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    return torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1)


@pytest.mark.parametrize("sc", PARAMS)
def test_split_forward_matches_float64(sc, spy):
    q, k, v = make_inputs(sc.case)[:3]
    with sc.forced():
        out, lse = flashbob.attention_forward(q, k, v, **sc.options())
    assert spy.splits == expected_launches(sc, q, k)
    mask, scale = explicit_mask(sc.range_case()), sc.case.d**-0.5
    assert rel_err(out, masked_attention(q.double(), k.double(), v.double(), mask, scale)) <= TOL
    want = reference_lse(q, k, mask, scale)
    empty = torch.isneginf(want)
    assert bool(empty.any()) == sc.empty_rows
    assert torch.equal(torch.isneginf(lse), empty) and bool((out[empty] == 0).all())
    assert float((lse.double() - want)[~empty].abs().max()) <= TOL


@pytest.mark.parametrize("sc", GRADIENT_PARAMS)
def test_gradients_after_a_split_forward_match_float64(sc, spy):
    """The backward reads the split forward's out and lse."""
    q, k, v, dout = make_inputs(sc.case)[:4]
    mask, scale = explicit_mask(sc.range_case()), sc.case.d**-0.5
    results = []
    for dtype in (torch.float32, torch.float64):
        args = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        with sc.forced():
            if dtype == torch.float32:
                out = flashbob.flash_attention(*args, **sc.options())
            else:
                out = masked_attention(*args, mask, scale)
        results.append(torch.autograd.grad(out, args, dout.to(dtype)))
    assert spy.splits == expected_launches(sc, q, k)
    for name, got, want in zip("qkv", *results):
        assert rel_err(got, want) <= TOL, name


def test_grad_of_grad_after_a_split_forward_matches_float64(spy):
    """The BoB reads the split forward's out and lse too."""
    sc = CASES[6]
    assert sc.empty_rows
    q, k, v, _, u_q, u_k, u_v = make_inputs(sc.case)
    mask, scale = explicit_mask(sc.range_case()), sc.case.d**-0.5

    def ours(q, k, v):
        return flashbob.flash_attention(q, k, v, **sc.options())

    def theirs(q, k, v):
        return masked_attention(q, k, v, mask, scale)

    results = []
    for f, dtype in ((ours, torch.float32), (theirs, torch.float64)):
        args = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        with sc.forced():
            loss = meta_loss(f, [t.to(dtype) for t in (u_q, u_k, u_v)])(*args)
        results.append(torch.autograd.grad(loss, args))
    assert spy.splits == expected_launches(sc, q, k)
    for name, got, want in zip("qkv", *results):
        assert rel_err(got, want) <= TOL, name


def test_the_rule_splits_few_rows_over_many_keys_to_fill_the_gpu_about_twice():
    assert tiling.split_keys(1, 8192, 12, 132) == 22        # a 125M model's decoded token on an H100
    assert tiling.split_keys(16, 8192, 12, 132) == 22
    assert tiling.split_keys(17, 8192, 12, 132) == 1        # more rows than one block of the split kernel
    assert tiling.split_keys(1, 8192, 66, 132) == 4
    assert tiling.split_keys(1, 8192, 67, 132) == 1         # the plain grid fills half of the SMs
    assert tiling.split_keys(1, 511, 1, 132) == 1           # not two splits' worth of keys
    assert tiling.split_keys(1, 512, 1, 132) == 2
    assert tiling.split_keys(1, 1 << 17, 1, 132) == tiling.MAX_SPLITS


def test_key_splits_count_the_window_and_the_device():
    q, k = torch.empty(1, 2, 1, 16, device=DEVICE), torch.empty(1, 1, 8192, 16, device=DEVICE)
    sms = tiling.device_sms(q.device)
    assert sms == (torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda"
                   else tiling.INTERPRETER_SMS)
    assert tiling.key_splits(q, k, None) == tiling.split_keys(1, 8192, 2, sms)
    assert tiling.key_splits(q, k, 600) == tiling.split_keys(1, 600, 2, sms)


def test_forced_splits_hold_in_their_block_only_and_turn_plans_off():
    q, k = torch.empty(1, 2, 40, 16), torch.empty(1, 1, 40, 16)
    assert tiling.key_splits(q, k, None) == 1 and not tiling.adjusted()
    with tiling.force_splits(7):
        assert tiling.key_splits(q, k, None) == 7 and tiling.adjusted()
    assert tiling.key_splits(q, k, None) == 1 and not tiling.adjusted()
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="force_splits takes a positive int"), tiling.force_splits(bad):
            pass
