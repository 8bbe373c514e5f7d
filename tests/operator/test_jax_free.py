"""The operator imports nothing of the trainer but its contract (`lorajob_trainer.contract`), and the contract imports
nothing but the standard library, pydantic, yaml and itself: the operator image installs no JAX and none of the
trainer's ML packages. Read from the source (every import, lazy ones inside functions too), so that a forbidden import
fails here even where no test runs the code that makes it; and checked once at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "lorajob_operator"
CONTRACT = ROOT / "trainer" / "lorajob_trainer" / "contract"
CONTRACT_PACKAGE = "lorajob_trainer.contract"
CONTRACT_THIRD_PARTY = {"pydantic", "yaml"}
"""What the contract may import beyond the standard library and itself (the base install's dependencies)."""
HEAVY = ("jax", "jaxlib", "flax", "numpy", "optax", "tunix", "orbax", "qwix", "ml_dtypes", "torch", "transformers",
         "datasets", "tokenizers", "safetensors", "tensorboardX", "pathwaysutils")
"""The trainer's packages, which the operator image does not install."""


def _package_of(path: Path) -> str:
    """The dotted name of the package a module of operator/ or trainer/ belongs to."""
    parts = path.relative_to(ROOT).parts[1:-1]  # operator/lorajob_operator/reconcile/x.py -> lorajob_operator.reconcile
    return ".".join(parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in `path`, at any depth: relative imports resolved, and `from M import n`
    as `M.n` (n may be a submodule); `importlib.import_module("M")` and `__import__("M")` with a constant too."""
    package = _package_of(path).split(".")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            if base == "__future__":
                continue
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "__import__")):
            yield node.lineno, node.args[0].value


def _in_contract(module: str) -> bool:
    return module == CONTRACT_PACKAGE or module.startswith(CONTRACT_PACKAGE + ".")


def _modules(package: Path) -> list[Path]:
    return sorted(package.rglob("*.py"))


def test_the_operator_imports_nothing_of_the_trainer_but_its_contract():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for path in _modules(OPERATOR) for line, module in imports(path)
                 if module.split(".")[0] == "lorajob_trainer" and not _in_contract(module)]
    assert offenders == [], "the operator imports the trainer outside lorajob_trainer.contract:\n" + "\n".join(offenders)


def test_the_operator_imports_no_trainer_package():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for path in _modules(OPERATOR) for line, module in imports(path) if module.split(".")[0] in HEAVY]
    assert offenders == [], "the operator imports the trainer's packages:\n" + "\n".join(offenders)


def test_the_contract_imports_the_standard_library_pydantic_yaml_and_itself_only():
    offenders = []
    for path in _modules(CONTRACT):
        for line, module in imports(path):
            top = module.split(".")[0]
            if _in_contract(module) or top in CONTRACT_THIRD_PARTY or top in sys.stdlib_module_names:
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert offenders == [], ("lorajob_trainer.contract imports beyond the standard library, pydantic, yaml and "
                             "itself:\n" + "\n".join(offenders))


def test_the_import_reader_sees_lazy_relative_and_dynamic_imports(tmp_path, monkeypatch):
    """The reader the rules above rest on: an import inside a function, a relative one, importlib's."""
    package = tmp_path / "operator" / "lorajob_operator" / "reconcile"
    package.mkdir(parents=True)
    source = package / "x.py"
    source.write_text("import json\nfrom .. import render\ndef f():\n    from lorajob_trainer import fit\n"
                      "    import importlib\n    importlib.import_module('jax.numpy')\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(module for _, module in imports(source)) == [
        "importlib", "jax.numpy", "json", "lorajob_operator.render", "lorajob_trainer.fit"]


@pytest.mark.parametrize("modules", [
    ["lorajob_trainer.contract." + path.stem for path in _modules(CONTRACT) if path.stem != "__init__"],
    ["lorajob_operator.handlers", "lorajob_operator.cli", "lorajob_operator.planning", "lorajob_operator.runview"],
], ids=["contract", "operator"])
def test_importing_loads_no_jax_and_nothing_of_the_trainer_but_its_contract(modules):
    code = (
        f"import importlib, sys\nfor name in {modules!r}: importlib.import_module(name)\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        f"trainer = sorted(m for m in sys.modules if m.split('.')[0] == 'lorajob_trainer' "
        f"and m not in ('lorajob_trainer', {CONTRACT_PACKAGE!r}) and not m.startswith({CONTRACT_PACKAGE + '.'!r}))\n"
        "assert not heavy and not trainer, (heavy, trainer)\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
