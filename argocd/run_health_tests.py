"""Run Argo CD health checks against their `health_test.yaml` cases with a real Lua 5.1 interpreter.

The layout is Argo CD's own (resource_customizations/<group>/<Kind>/{health.lua, health_test.yaml,
testdata/}): each case names an input resource and the status and message the script must return.
Argo CD runs these scripts in gopher-lua, a Lua 5.1 implementation; `lua5.1` (Debian package lua5.1)
runs them here through health_driver.lua, which gives the script the same globals.

    python argocd/run_health_tests.py [CUSTOMIZATIONS_DIR]     # exit status 1 if any case fails
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CUSTOMIZATIONS = HERE / "resource_customizations"
DRIVER = HERE / "health_driver.lua"
LUA = "lua5.1"


class LuaNotInstalled(RuntimeError):
    pass


def lua_literal(value) -> str:
    """A Lua table constructor for decoded YAML/JSON, as Argo CD hands it to the script (null is nil)."""
    if isinstance(value, dict):
        items = (f"[{lua_literal(str(k))}]={lua_literal(v)}" for k, v in value.items() if v is not None)
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        return "{" + ",".join(lua_literal(v) for v in value) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"no Lua literal for {value}")
        return repr(value)
    if isinstance(value, str):
        escaped = "".join(ch if ch.isprintable() and ch not in '"\\' else f"\\{ord(ch):03d}" for ch in value)
        return f'"{escaped}"'
    raise TypeError(f"cannot express {type(value).__name__} in Lua")


@dataclasses.dataclass(frozen=True)
class HealthCase:
    script: Path
    input_path: Path
    status: str
    message: str

    @property
    def name(self) -> str:
        return f"{self.script.parent.parent.name}/{self.script.parent.name}:{self.input_path.stem}"


@dataclasses.dataclass(frozen=True)
class HealthResult:
    status: str
    message: str


def lua_binary() -> str:
    found = shutil.which(LUA)
    if found is None:
        raise LuaNotInstalled(f"{LUA} is not on PATH: run scripts/install-system-packages.sh (Debian package lua5.1)")
    return found


def run_health(script: Path, obj: dict) -> HealthResult:
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as object_file:
        object_file.write("return " + lua_literal(obj) + "\n")
        object_file.flush()
        result = subprocess.run(
            [lua_binary(), str(DRIVER), str(script), object_file.name], capture_output=True, text=True, timeout=30
        )
    if result.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {result.returncode}): {result.stderr.strip()}")
    status, _, message = result.stdout.partition("\n")
    return HealthResult(status, message)


def cases(customizations: Path = CUSTOMIZATIONS) -> list[HealthCase]:
    found = []
    for test_file in sorted(customizations.glob("*/*/health_test.yaml")):
        script = test_file.parent / "health.lua"
        for case in yaml.safe_load(test_file.read_text())["tests"]:
            expected = case["healthStatus"]
            found.append(
                HealthCase(script, test_file.parent / case["inputPath"], expected["status"], expected.get("message", ""))
            )
    return found


def run_case(case: HealthCase) -> HealthResult:
    return run_health(case.script, yaml.safe_load(case.input_path.read_text()))


def main(argv: list[str]) -> int:
    customizations = Path(argv[0]) if argv else CUSTOMIZATIONS
    passed = failed = 0
    for case in cases(customizations):
        got = run_case(case)
        if (got.status, got.message) == (case.status, case.message):
            passed += 1
        else:
            failed += 1
            print(f"FAIL {case.name}: expected {case.status} {case.message!r}, got {got.status} {got.message!r}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
