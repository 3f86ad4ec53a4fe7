"""transformers tests: skipped without transformers; registers attn_implementation "bob" (auto
backend: torch on the CPU) and "bob_triton" (the Triton kernels; the interpreter on the CPU)."""

import pytest

pytest.importorskip("transformers")

import flashbob  # noqa: E402

flashbob.register_transformers("bob")
flashbob.register_transformers("bob_triton", backend="triton")
