"""Nothing above the evaluator seam names a CKKS library: the block, linear algebra and packing program
against ``fhe.evaluator`` only (issue 14), and importing them loads no library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Backend-neutral modules: everything the encrypted block is made of, and the protocol itself.
ABOVE_THE_SEAM = ("evaluator", "linalg", "packing", "geometry", "weight_maps", "sizing", "kv_cache", "packed",
                  "attention", "block_client", "simulator", "approx", "plan", "params", "mlp", "offload", "silu",
                  "offload_sim", "mlp_poly")
#: Modules that are one backend's (SEAL's) and may not be imported from above the seam.
BACKEND_MODULES = ("tenseal", "fhe.hazmat", "fhe.backends.seal", "fhe.backends.gpu", "fhe.ckks", "fhe.wire")
LIBRARY_WORDS = ("seal", "tenseal")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may mention a library; code may not)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def library_mentions(source: str, name: str) -> list[str]:
    """Imports of a backend module, and identifiers or (non-docstring) strings naming a library."""
    tree = ast.parse(source, name)
    docs, bad = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""]
        else:
            mods = []
        bad += [f"imports {m}" for m in mods if any(m == b or m.startswith(b + ".") for b in BACKEND_MODULES)]
        words = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.alias):
            words = [node.name, node.asname or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            words = [node.value]
        bad += [f"names {w!r}" for w in words if any(lib in w.lower() for lib in LIBRARY_WORDS)]
    return bad


@pytest.mark.parametrize("module", ABOVE_THE_SEAM)
def test_nothing_above_the_seam_names_a_library(module):
    path = ROOT / "fhe" / f"{module}.py"
    assert not library_mentions(path.read_text(), str(path))


def test_the_checker_sees_library_names():
    src = ('"""Docstrings may say SEAL."""\nfrom fhe.hazmat.seal import Kit\nimport tenseal.sealapi as sa\n'
           'def f(kit):\n    """SEAL here is fine."""\n    return kit.evaluator.seal_thing, "seal"\n')
    assert set(library_mentions(src, "x.py")) == {"imports fhe.hazmat.seal", "imports tenseal.sealapi",
                                                  "names 'tenseal.sealapi'", "names 'seal_thing'", "names 'seal'"}


def test_importing_the_block_loads_no_library():
    """The registry (fhe.backends) names backends but imports one only when asked for it."""
    mods = ", ".join(f"fhe.{m}" for m in ABOVE_THE_SEAM)
    code = (f"import sys, fhe, fhe.backends, {mods}\n"
            "bad = [m for m in sys.modules if m.startswith(('tenseal', 'fhe.hazmat', 'fhe.backends.seal'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
