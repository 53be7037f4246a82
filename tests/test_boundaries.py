"""The import arrows of DESIGN.md §1 hold, and our top-level names resolve to this repository."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "fhe", "server", "client_sdk")
ALLOWED = {
    "engine": {"kernels"},
    "kernels": set(),
    "fhe": {"engine"},
    "server": {"engine", "fhe"},
    "client_sdk": {"fhe", "engine"},
}

#: The one deliberate exception: `cipherlm demo` is a client of a server it starts as a separate process,
#: so the demo module (and only it) uses the SDK. docs/architecture.md records why.
EXCEPTIONS = {"server/cli_demo.py": {"client_sdk"}}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of our packages that a file imports (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names} & set(PACKAGES)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_import_directions(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for dep in imported_packages(path) - ALLOWED[package] - {package} - EXCEPTIONS.get(rel, set()):
            bad.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_resolve_to_this_repo(package):
    mod = importlib.import_module(package)
    assert Path(mod.__file__).resolve().parent == ROOT / package


def test_the_checker_sees_violations(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import server.app\nfrom engine import model\nimport os\n")
    assert imported_packages(f) == {"server", "engine"}


def test_no_foreign_distribution_claims_our_package_names():
    """Hugging Face's `kernels` distribution (a hard requirement of transformers 5.25+) installs a `kernels`
    package that transformers then imports and finds ours instead: every model import fails. pyproject pins
    transformers below 5.25; this names the cause if an environment has it anyway."""
    from importlib.metadata import PackageNotFoundError, distribution

    for name in PACKAGES:
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        pytest.fail(f"the distribution {dist.metadata['Name']} {dist.version} is installed and claims the "
                    f"import name {name!r}, which is this repo's package: uninstall it (pip uninstall {name})")
