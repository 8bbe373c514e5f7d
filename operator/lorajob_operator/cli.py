"""The `lorajob` command: offline checks and previews of LoRAJob files, without a cluster."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def validate_files(paths: list[Path]) -> int:
    from lorajob_operator.validation import validate

    failed = 0
    for path in paths:
        for doc in _documents(path):
            name = doc.get("metadata", {}).get("name", "?")
            errors = validate(doc)
            if errors:
                failed += 1
                print(f"{path}: LoRAJob {name!r} is invalid:")
                for error in errors:
                    print(f"  {error}")
            else:
                print(f"{path}: LoRAJob {name!r} is valid")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorajob", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check LoRAJob files with the same rules as the API server")
    validate.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "validate":
        return validate_files(args.files)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
