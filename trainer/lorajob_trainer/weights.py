"""Base weights: HF safetensors and our Orbax checkpoints -> sharded JAX arrays.

Every parameter is created with `jax.make_array_from_callback`, so each process reads only the
slices its own devices hold: only the rows of the safetensors tensors a slice covers are read from
the files (the HF -> Tunix transpose/reshape is applied to the slice, see `read_slice`), and Orbax
restores into the target shardings.

Our base checkpoint layout (written by `python -m lorajob_trainer.convert base`):

    <dir>/config.json            the HF config (the family and shapes come from it)
    <dir>/tokenizer*.json, ...   tokenizer files copied from the HF directory, when present
    <dir>/lorajob_base.json      {"format": "lorajob-base/v1", "family": ..., "dtype": ...}
    <dir>/params/                Orbax PyTree (OCDBT and zarr3 off, readable by Pathways)
                                 of the Tunix parameters, nested by NNX path with string keys
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from lorajob_trainer import storage
from lorajob_trainer.mesh import variable_sharding
from lorajob_trainer.models.families import TensorMap

log = logging.getLogger(__name__)

BASE_MARKER = "lorajob_base.json"
BASE_FORMAT = "lorajob-base/v1"

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class WeightsError(ValueError):
    """A checkpoint is missing, malformed, or does not match the model config."""


# --- safetensors -------------------------------------------------------------------------------


class SafetensorsDir:
    """All tensors of a directory of `*.safetensors` files (sharded or not), read by name and slice.

    Reads are explicit (`pread` of the rows a slice covers, in bounded chunks), not memory-mapped:
    mapped file pages count in a process's RSS, and a column slice of a row-major tensor touches
    every page of it, so each process would carry every tensor it takes a column shard of.
    """

    CHUNK_BYTES = 16 * 2**20
    """Upper bound of the temporary buffer of a read that keeps only some columns of its rows."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).resolve()
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{self.directory} holds no *.safetensors files")
        self._entries: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for path in files:
            for name, (data_start, entry) in _read_header(path).items():
                if name in self._entries:
                    raise WeightsError(f"tensor {name} appears in both {self._entries[name][0].name} and {path.name}")
                self._entries[name] = (path, data_start, entry)

    def names(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[2]["shape"])

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """The `index` slice (unit steps) of one tensor; only the rows of the first axis it covers are read."""
        path, data_start, entry = self._entry(name)
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise WeightsError(f"tensor {name} in {path.name} has unsupported dtype {entry['dtype']}")
        dtype = np.dtype(dtype)
        shape = tuple(entry["shape"])
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        ranges = _normalise(index, shape)
        if any(r.step != 1 for r in ranges):
            raise ValueError(f"tensor {name}: only unit-step slices can be read, got {index}")
        out = np.empty([len(r) for r in ranges], dtype)
        if out.size == 0:
            return out
        if not shape:
            rows, row_shape, columns = range(1), (), ()
        else:
            rows, row_shape, columns = ranges[0], shape[1:], tuple(slice(r.start, r.stop) for r in ranges[1:])
        row_bytes = math.prod(row_shape) * dtype.itemsize
        offset = data_start + entry["data_offsets"][0] + rows.start * row_bytes
        with path.open("rb", buffering=0) as file:
            if out.shape[1:] == row_shape:  # whole rows: straight into the result
                _pread_into(file, out, offset)
                return out
            step = max(1, self.CHUNK_BYTES // row_bytes)
            buffer = np.empty((min(step, len(rows)), *row_shape), dtype)
            for start in range(0, len(rows), step):
                chunk = buffer[: min(step, len(rows) - start)]
                _pread_into(file, chunk, offset + start * row_bytes)
                out[start : start + len(chunk)] = chunk[(slice(None), *columns)]
        return out

    def _entry(self, name: str) -> tuple[Path, int, dict[str, Any]]:
        try:
            return self._entries[name]
        except KeyError:
            raise WeightsError(f"tensor {name} is not in the safetensors files of {self.directory}") from None


def _pread_into(file: Any, array: np.ndarray, offset: int) -> None:
    """Fill the contiguous `array` with the file's bytes from `offset`; WeightsError if the file ends first."""
    view = memoryview(array.reshape(-1).view(np.uint8))
    while view:
        count = os.preadv(file.fileno(), [view], offset)
        if count == 0:
            raise WeightsError(f"{file.name} ends before the tensor data its header announces (truncated file?)")
        view, offset = view[count:], offset + count


def _read_header(path: Path) -> dict[str, tuple[int, dict[str, Any]]]:
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise WeightsError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(file.read(header_len))
        except ValueError as error:
            raise WeightsError(f"{path} has a corrupt safetensors header: {error}") from error
    header.pop("__metadata__", None)
    return {name: (8 + header_len, entry) for name, entry in header.items()}


def decoder_prefix(names: Iterable[str]) -> str:
    """The name prefix of the decoder stack (`model.`, `model.language_model.`, ...)."""
    candidates = sorted(name[: -len("embed_tokens.weight")] for name in names if name.endswith("embed_tokens.weight"))
    if not candidates:
        raise WeightsError("the checkpoint has no embed_tokens.weight tensor")
    return candidates[0]


def save_hf_safetensors(directory: str | Path, tensors: Mapping[str, np.ndarray], *, shards: int = 1) -> None:
    """Write `tensors` as `model.safetensors`, or as `shards` files plus `model.safetensors.index.json`."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({name: tensors[name] for name in names}, directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for shard, chunk in enumerate(np.array_split(np.array(names), shards)):
        filename = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file({str(name): tensors[name] for name in chunk}, directory / filename, metadata={"format": "pt"})
        weight_map.update({str(name): filename for name in chunk})
    index = {"metadata": {"total_size": sum(int(t.nbytes) for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def hf_tensors(
    params: Mapping[str, np.ndarray], tensor_maps: list[TensorMap], prefix: str = "model."
) -> dict[str, np.ndarray]:
    """Tunix params (flat) -> HF-named tensors, the inverse of `load_safetensors_state`."""
    tensors = {}
    for tmap in tensor_maps:
        for name, part in zip(tmap.hf, to_hf(tmap, np.asarray(params[tmap.ours]))):
            tensors[(prefix if tmap.prefixed else "") + name] = part
    return tensors


# --- layout transforms -------------------------------------------------------------------------


def _parse_axes(pattern: str) -> list[list[str]]:
    """`(n h) d` -> [['n', 'h'], ['d']]."""
    groups = re.findall(r"\(([^)]*)\)|(\w+)", pattern)
    return [group.split() if group else [single] for group, single in groups]


def _normalise(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[range]:
    return [range(*s.indices(dim)) for s, dim in zip(index, shape)]


def read_slice(
    source: SafetensorsDir, prefix: str, tmap: TensorMap, shape: tuple[int, ...], index: tuple[slice, ...]
) -> np.ndarray:
    """The `index` slice of the Tunix parameter `tmap` (global `shape`), read from HF tensors.

    For every HF axis only the rows covering the requested outer-axis range are read; inner split
    axes (such as head_dim in `(n h)`) are cut after the reshape.
    """
    names = [(prefix if tmap.prefixed else "") + name for name in tmap.hf]
    if tmap.hf_axes is None:
        return source.read(names[0], index)
    ours = tmap.ours_axes.split()
    ranges = dict(zip(ours, _normalise(index, shape)))
    sizes = dict(zip(ours, shape))
    stacked = len(names) > 1
    selected = [names[i] for i in ranges[ours[0]]] if stacked else names
    parts = [_read_one(source, name, _parse_axes(tmap.hf_axes), ours[stacked:], ranges, sizes) for name in selected]
    return np.stack(parts) if stacked else parts[0]


def _read_one(
    source: SafetensorsDir,
    hf_name: str,
    groups: list[list[str]],
    ours: list[str],
    ranges: dict[str, range],
    sizes: dict[str, int],
) -> np.ndarray:
    hf_index, chunk_axes, chunk_shape = [], [], []
    for group in groups:
        outer, inner = group[0], group[1:]
        inner_size = math.prod(sizes[name] for name in inner)
        rows = ranges[outer]
        hf_index.append(slice(rows.start * inner_size, rows.stop * inner_size))
        chunk_axes += group
        chunk_shape += [len(rows)] + [sizes[name] for name in inner]
    chunk = source.read(hf_name, tuple(hf_index)).reshape(chunk_shape)
    chunk = chunk.transpose([chunk_axes.index(name) for name in ours])
    outers = {group[0] for group in groups}
    inner_cut = tuple(slice(None) if name in outers else slice(ranges[name].start, ranges[name].stop) for name in ours)
    return chunk[inner_cut]


def to_hf(tmap: TensorMap, value: np.ndarray) -> list[np.ndarray]:
    """The HF tensors (one per name in `tmap.hf`) holding the Tunix parameter `value`."""
    if tmap.hf_axes is None:
        return [value]
    ours = tmap.ours_axes.split()
    parts = list(value) if len(tmap.hf) > 1 else [value]
    ours = ours[1:] if len(tmap.hf) > 1 else ours
    sizes = dict(zip(ours, parts[0].shape))
    groups = _parse_axes(tmap.hf_axes)
    order = [ours.index(name) for group in groups for name in group]
    return [
        np.ascontiguousarray(part.transpose(order).reshape([math.prod(sizes[n] for n in g) for g in groups]))
        for part in parts
    ]


def path_key(path: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in path)


def load_safetensors_state(
    abstract_state: nnx.State, tensor_maps: list[TensorMap], directory: str | Path, *, mesh: Mesh, dtype: Any
) -> nnx.State:
    """Fill an abstract NNX state from HF safetensors; WeightsError names any missing/misshapen tensor."""
    source = SafetensorsDir(directory)
    prefix = decoder_prefix(source.names())
    by_path = {tmap.ours: tmap for tmap in tensor_maps}
    flat = nnx.to_flat_state(abstract_state)
    wanted = {path_key(path) for path, _ in flat}
    if wanted != set(by_path):
        raise WeightsError(f"internal: tensor maps do not cover the model: {sorted(wanted ^ set(by_path))[:5]}")
    _check_present(source, prefix, tensor_maps)
    used = set()
    for path, variable in flat:
        tmap = by_path[path_key(path)]
        used.update((prefix if tmap.prefixed else "") + name for name in tmap.hf)
        shape = tuple(variable.get_value().shape)
        _check_shape(source, prefix, tmap, shape)
        variable.set_value(
            jax.make_array_from_callback(
                shape,
                variable_sharding(mesh, variable),
                lambda index, tmap=tmap, shape=shape: read_slice(source, prefix, tmap, shape, index).astype(
                    dtype, copy=False
                ),
            )
        )
    unused = sorted(source.names() - used)
    if unused:
        log.warning("ignoring %d tensors of %s not used by the model, e.g. %s", len(unused), directory, unused[:3])
    return abstract_state


def _check_present(source: SafetensorsDir, prefix: str, tensor_maps: list[TensorMap]) -> None:
    missing = [
        (prefix if tmap.prefixed else "") + name
        for tmap in tensor_maps
        for name in tmap.hf
        if (prefix if tmap.prefixed else "") + name not in source.names()
    ]
    if missing:
        raise WeightsError(
            f"{source.directory} lacks {len(missing)} tensors the config.json requires, e.g. {missing[:3]} "
            "(does config.json belong to these weights?)"
        )


def _check_shape(source: SafetensorsDir, prefix: str, tmap: TensorMap, shape: tuple[int, ...]) -> None:
    expected = [part.shape for part in to_hf(tmap, np.empty(shape, dtype=np.int8))]
    for name, want in zip(tmap.hf, expected):
        full = (prefix if tmap.prefixed else "") + name
        if source.shape(full) != tuple(want):
            raise WeightsError(f"tensor {full} has shape {source.shape(full)}, config.json implies {tuple(want)}")


# --- our Orbax base checkpoints ----------------------------------------------------------------


def _handler() -> ocp.PyTreeCheckpointHandler:
    return ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}} (the on-disk tree of our Orbax checkpoints)."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of `nest`."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def save_orbax_params(directory: str | Path, params: Mapping[str, jax.Array]) -> None:
    """Write a flat {nnx path: array} dict as an Orbax PyTree at `directory` (resolved to an absolute path)."""
    with ocp.Checkpointer(_handler()) as checkpointer:
        checkpointer.save(Path(directory).resolve(), args=ocp.args.PyTreeSave(nest(params)))


def restore_orbax_params(
    location: str | epath.PathLike, targets: Mapping[str, jax.ShapeDtypeStruct], *, partial: bool = False
) -> dict[str, jax.Array]:
    """Restore the arrays `targets` (flat, dotted keys) of the Orbax PyTree at `location` into their
    shapes, dtypes and shardings; WeightsError on mismatch.

    `location` is a local path (made absolute: Orbax requires it) or a gs:// URI, read in place;
    OCDBT/zarr3 on or off. `partial`: the checkpoint may hold more arrays than `targets`.
    """
    location = epath.Path(location if storage.is_remote(str(location)) else Path(location).resolve())
    if not location.is_dir():
        raise WeightsError(f"{location} is not an Orbax checkpoint directory")
    abstract = nest(targets)
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(
                location,
                args=ocp.args.PyTreeRestore(
                    item=abstract,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    partial_restore=partial,
                ),
            )
    except (ValueError, KeyError, FileNotFoundError) as error:
        raise WeightsError(f"cannot restore {location} into the model: {error}") from error
    return flatten(restored)


def load_orbax_state(
    abstract_state: nnx.State, location: str | epath.PathLike, *, mesh: Mesh, dtype: Any
) -> nnx.State:
    """Our Orbax base parameters (module docstring layout), restored in place from a local path or gs:// URI."""
    flat = nnx.to_flat_state(abstract_state)
    targets = {
        path_key(path): jax.ShapeDtypeStruct(
            variable.get_value().shape, dtype, sharding=variable_sharding(mesh, variable)
        )
        for path, variable in flat
    }
    values = restore_orbax_params(location, targets)
    for path, variable in flat:
        variable.set_value(values[path_key(path)])
    return abstract_state


def read_base_marker(directory: Path) -> dict[str, Any]:
    marker = json.loads((directory / BASE_MARKER).read_text())
    if marker.get("format") != BASE_FORMAT:
        raise WeightsError(f"{directory / BASE_MARKER} has format {marker.get('format')!r}, expected {BASE_FORMAT}")
    return marker
