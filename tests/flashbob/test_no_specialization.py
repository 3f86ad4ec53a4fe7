"""Every Triton kernel is declared not to specialize on sequence lengths, head counts, offsets and
windows (`flashbob._tiles.NO_SPECIALIZE`), so a new length of other divisibility reuses the compiled
kernel. Read from the source: under the CPU interpreter the decorators keep no such attribute."""

import ast
from pathlib import Path

import pytest

from flashbob._tiles import NO_SPECIALIZE

KERNEL_FILES = sorted((Path(__file__).resolve().parents[2] / "flashbob").glob("_*.py"))


def _jit_kernels():
    for path in KERNEL_FILES:
        tree = ast.parse(path.read_text())
        constants = {
            target.id: node.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):  # launched, not inlined
                for deco in node.decorator_list:
                    if "triton.jit" in ast.unparse(deco):
                        yield path.name, node, deco, constants


def _declared(deco, constants) -> set[str]:
    if not isinstance(deco, ast.Call):
        return set()
    for keyword in deco.keywords:
        if keyword.arg == "do_not_specialize":
            value = keyword.value
            if isinstance(value, ast.Name) and value.id == "NO_SPECIALIZE":
                return set(NO_SPECIALIZE)
            if isinstance(value, ast.Name):
                value = constants[value.id]
            if isinstance(value, ast.ListComp):  # [name for name in NO_SPECIALIZE if name != ...]
                return {n for n in NO_SPECIALIZE if n not in ast.unparse(value.generators[0].ifs[0])}
            return {ast.literal_eval(element) for element in value.elts}
    return set()


KERNELS = list(_jit_kernels())


@pytest.mark.parametrize(
    "file, node, deco, constants", KERNELS, ids=[f"{k[0]}:{k[1].name}" for k in KERNELS]
)
def test_kernel_does_not_specialize_on_lengths(file, node, deco, constants):
    params = {arg.arg for arg in node.args.args}
    lengths = params & set(NO_SPECIALIZE)
    if not lengths:
        pytest.skip("takes no length or count")
    declared = _declared(deco, constants)
    assert lengths <= declared, f"{file}:{node.name} specializes on {sorted(lengths - declared)}"
