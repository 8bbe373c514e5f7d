"""Repository layout rules that would otherwise fail late or confusingly."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_test_module_basenames_are_unique():
    # pytest's default import mode puts each test folder on sys.path; two test_x.py would collide.
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
