"""Bytes a compiled step moves between devices, read from its optimized HLO (`compiled.as_text()`).

Each collective instruction is counted as often as it runs: a while loop's body (the layers' scan, the
gradient-accumulation scan, the loss's chunks) by its trip count (the CPU compiler's `known_trip_count`; the TPU
compiler writes none, so the bound its condition compares the counter with, as JAX's loops count from 0 by 1),
every other called computation once per call (both branches of a conditional, so an upper bound there). Bytes are what one device sends in the
usual ring or pairwise algorithms, from the instruction's operands and its group of n devices: all-gather
operand x (n - 1), reduce-scatter and all-to-all operand x (n - 1) / n, all-reduce 2 x operand x (n - 1) / n,
collective-permute its operand. Async pairs are counted at their start (the `-done` half moves nothing new).
"""

from __future__ import annotations

import re
from collections import defaultdict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")

_HEADER = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<type>.*?) (?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[a-z]+(?P<bits>\d+)[a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_OPERAND = re.compile(r"%(?P<name>[\w.\-]+)")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%(?P<name>[\w.\-]+)")
_CONSTANT = re.compile(r"^(?P<value>-?\d+)\)")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[\d+,(?P<size>\d+)\]")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\] \{(?P<chosen>[^}]*)\}")


def array_bytes(text: str) -> int:
    """Bytes of every array type written in `text` (a tuple type: all its elements)."""
    total = 0
    for match in _ARRAY.finditer(text):
        bits = 8 if match["dtype"] == "pred" else int(match["bits"])
        count = 1
        for dim in filter(None, match["dims"].split(",")):
            count *= int(dim)
        total += count * bits // 8
    return total


def group_size(attributes: str) -> int:
    """The devices of one replica group of a collective, from its `replica_groups` in any of XLA's three spellings."""
    if match := _EXPLICIT_GROUPS.search(attributes):
        return len(match["first"].split(","))
    if match := _IOTA_GROUPS.search(attributes):
        return int(match["size"])
    if match := _MESH_GROUPS.search(attributes):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", match["axes"]))
        size = 1
        for axis in re.findall(r"'([^']+)'", match["chosen"]):
            size *= int(sizes[axis])
        return size
    return 1


def _sent(kind: str, operand_bytes: int, n: int) -> float:
    if kind == "all-gather":
        return operand_bytes * (n - 1)
    if kind == "all-reduce":
        return 2 * operand_bytes * (n - 1) / n
    if kind == "collective-permute":
        return operand_bytes
    return operand_bytes * (n - 1) / n


def collective_bytes(hlo: str) -> dict[str, float]:
    """{collective kind: bytes one device sends per run of the module} (see module docstring); kinds absent: 0."""
    types: dict[str, str] = {}
    computations: dict[str, list[re.Match]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if header := _HEADER.match(line):
            current = header["name"]
            computations[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and (instruction := _INSTRUCTION.match(line)):
            computations[current].append(instruction)
            types[instruction["name"]] = instruction["type"]
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, instructions in computations.items():
        for instruction in instructions:
            rest = instruction["rest"]
            trips = _trips(rest, computations) if instruction["op"] == "while" else 1
            called = [m["name"] for m in _CALLED.finditer(rest)]
            for branches in _BRANCHES.finditer(rest):
                called += [b.strip().lstrip("%") for b in branches["names"].split(",")]
            calls[name] += [(callee, trips) for callee in called if callee in computations]
    runs = _runs(entry, calls)
    sent = dict.fromkeys(KINDS, 0.0)
    for name, instructions in computations.items():
        for instruction in instructions:
            kind = instruction["op"].removesuffix("-start")
            if kind not in KINDS or not runs.get(name):
                continue
            operands_text = instruction["rest"].split(")", 1)[0]
            operands = [m["name"] for m in _OPERAND.finditer(operands_text)]
            if kind == "ragged-all-to-all":
                operands = operands[:1]  # the rows sent; the others are the output buffer and offsets
            operand_bytes = sum(array_bytes(types.get(operand, "")) for operand in operands)
            sent[kind] += runs[name] * _sent(kind, operand_bytes, group_size(instruction["rest"]))
    return sent


def _trips(rest: str, computations: dict[str, list[re.Match]]) -> int:
    """A while loop's trip count (see module docstring); 1 where neither says it."""
    if match := _TRIP_COUNT.search(rest):
        return int(match["n"])
    condition = computations.get(match["name"], []) if (match := _CONDITION.search(rest)) else []
    constants = {i["name"]: int(c["value"]) for i in condition if i["op"] == "constant" and (c := _CONSTANT.match(i["rest"]))}
    for instruction in condition:
        if instruction["op"] == "compare" and "direction=LT" in instruction["rest"]:
            bounds = [constants[m["name"]] for m in _OPERAND.finditer(instruction["rest"].split(")", 1)[0])
                      if m["name"] in constants]
            if bounds:
                return bounds[0]
    return 1


def _runs(entry: str | None, calls: dict[str, list[tuple[str, int]]]) -> dict[str, int]:
    """How many times each computation reachable from `entry` runs per run of the module."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        seen.add(name)
        for callee, _ in calls.get(name, []):
            if callee not in seen:
                visit(callee)
        order.append(name)

    if entry is None:
        return {}
    visit(entry)
    runs = defaultdict(int, {entry: 1})
    for name in reversed(order):  # callers before their callees
        for callee, trips in calls.get(name, []):
            runs[callee] += runs[name] * trips
    return dict(runs)
