"""Supervised fine-tuning data: load, format with a chat template, mask, pack, shard, resume.

Layout of a batch. A global batch has R rows (R = accumulation steps x per-device batch x
devices). Row g is an independent packer that reads the examples at positions g, g+R, g+2R, ...
of an endless sequence of epochs (each epoch is a seeded permutation of the dataset). So:

- each process reads only the rows its devices hold, and therefore only its share of examples;
- the batch does not depend on how many processes there are (same loss for 1 or N processes);
- the iterator state is one integer per row (examples consumed), saved with the checkpoint, so a
  resumed run neither replays nor skips data.

Each example becomes token ids plus a loss mask that is true only on assistant (answer) tokens:
the prompt and the assistant header are found as the longest common prefix between the
conversation rendered up to an assistant turn and the prompt rendered with a generation prompt.

Speed: training batches are prepared by a background thread while the device runs the previous
step (`PrefetchedRows`), and encoded examples are cached within a token budget, so later epochs
and repeated evaluations skip rendering and tokenizing.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from lorajob_trainer.contract.records import PREFERENCE_COLUMN_LAYOUTS
from lorajob_trainer.contract.rows import DataError, to_messages, to_preference_messages

if TYPE_CHECKING:
    from lorajob_trainer.contract.config import TrainConfig

log = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

ENCODED_CACHE_TOKENS = 1 << 24
"""Default budget of the encoded-example cache: 16M tokens, about 80 MB (int32 ids + bool mask)."""

OnDataEnd = Literal["continue", "fail", "pad"]
"""continue: start the next epoch; fail: raise DataExhausted; pad: emit empty rows (evaluation)."""


class DataExhausted(RuntimeError):
    """The training data ran out and further epochs are not allowed."""


@dataclass(frozen=True)
class DataSource:
    """Where one split comes from: hub/builder name or local files."""

    hf_path: str = ""
    hf_name: str = ""
    hf_data_dir: str = ""
    split: str = "train"
    files: tuple[str, ...] = ()


def train_source(config: TrainConfig) -> DataSource:
    c = config
    return DataSource(c.hf_path, c.hf_name, c.hf_data_dir, c.train_split, tuple(c.hf_train_files or ()))


def eval_source(config: TrainConfig) -> DataSource:
    c = config
    return DataSource(c.hf_path, c.hf_name, c.hf_data_dir, c.hf_eval_split, tuple(c.hf_eval_files or ()))


@dataclass(frozen=True)
class EncodedExample:
    tokens: np.ndarray
    """[n] int32 token ids of the whole conversation."""
    loss_mask: np.ndarray
    """[n] bool, true on tokens the model is trained to produce."""

    @property
    def size(self) -> int:
        """Tokens held (the encoded-example cache's budget counts them)."""
        return len(self.tokens)


@dataclass(frozen=True)
class EncodedPair:
    """A preference example: the prompt with the chosen answer and with the rejected one, each loss mask true on
    its answer's tokens only."""

    chosen: EncodedExample
    rejected: EncodedExample

    @property
    def size(self) -> int:
        return self.chosen.size + self.rejected.size


# ---------------------------------------------------------------- loading


def load_dataset_split(source: DataSource, columns: Sequence[str]):
    """A map-style (random access) Hugging Face dataset with the requested columns."""
    import datasets

    if source.files:
        data_files = _expand_files(source.files)
        builder = source.hf_path or _builder_for(data_files)
        if all(Path(f).stat().st_size == 0 for f in data_files):
            raise DataError(f"dataset is empty: {', '.join(data_files)} hold no bytes")
        dataset = datasets.load_dataset(builder, data_files=data_files, split="train")
    elif source.hf_path:
        dataset = datasets.load_dataset(
            source.hf_path, name=source.hf_name or None, data_dir=source.hf_data_dir or None, split=source.split
        )
    else:
        raise DataError("no data source: set hf_path or data files")
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise DataError(f"dataset lacks column(s) {missing}; it has {dataset.column_names}")
    if len(dataset) == 0:
        raise DataError("dataset is empty")
    return dataset.select_columns(list(columns))


def _expand_files(paths: Sequence[str]) -> list[str]:
    files: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*") if f.is_file() and f.suffix in FILE_BUILDERS)
            if not found:
                raise DataError(f"data directory {path} holds no {'/'.join(FILE_BUILDERS)} files")
            files.extend(found)
        elif path.is_file():
            files.append(str(path))
        else:
            raise DataError(f"data file {path} does not exist")
    return files


def _builder_for(files: Sequence[str]) -> str:
    builders = {FILE_BUILDERS.get(Path(f).suffix) for f in files}
    if len(builders) != 1 or None in builders:
        raise DataError(f"cannot infer one dataset format from {list(files)[:5]}; set hf_path (json, parquet, csv)")
    return builders.pop()


# ---------------------------------------------------------------- tokenizer and template


def load_tokenizer(tokenizer_path: str, chat_template_path: str = ""):
    """A Hugging Face tokenizer whose chat template is the file's, or its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if chat_template_path:
        tokenizer.chat_template = read_chat_template(Path(chat_template_path))
    if not tokenizer.chat_template:
        raise DataError(f"tokenizer at {tokenizer_path} has no chat template; set chat_template_path")
    check_chat_template(tokenizer, chat_template_path or tokenizer_path)
    return tokenizer


SAMPLE_CONVERSATION = ({"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"})


def check_chat_template(tokenizer, source: str) -> None:
    """DataError unless the chat template renders a user/assistant exchange (found before step 1, not in it)."""
    try:
        tokenizer.apply_chat_template(list(SAMPLE_CONVERSATION), tokenize=False)
    except Exception as error:  # noqa: BLE001 - Jinja syntax, undefined names and the template's raise_exception
        raise DataError(
            f"the chat template of {source} does not render a user/assistant conversation: "
            f"{type(error).__name__}: {error}"
        ) from None


def read_chat_template(path: Path) -> str:
    if not path.is_file():
        raise DataError(f"chat_template_path {path} does not exist")
    text = path.read_text()
    if path.suffix != ".json":
        return text
    try:
        template = json.loads(text)["chat_template"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f"chat template file {path} must be JSON with a 'chat_template' string") from None
    if not isinstance(template, str):
        raise DataError(f"chat template file {path}: 'chat_template' must be a string")
    return template


# ---------------------------------------------------------------- formatting and masking


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> token ids, no special tokens added (the chat template writes those).

    A fast tokenizer is called through its Rust backend: the Python wrapper's call path costs
    about twice as much per example and updates the backend's padding/truncation settings on
    every call, which is not safe while the prefetch thread encodes with the same tokenizer.
    """
    if getattr(tokenizer, "is_fast", False):
        backend = tokenizer.backend_tokenizer
        return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def encode_conversation(
    tokenizer, messages: list[dict[str, str]], encode_text: Callable[[str], list[int]] | None = None,
    first_trained_turn: int = 0,
) -> EncodedExample:
    """Token ids of the conversation and a mask that is true on the tokens of its assistant messages from
    `first_trained_turn` on."""
    if not any(m["role"] == "assistant" for m in messages[first_trained_turn:]):
        raise DataError("a conversation has no assistant message to train on")
    encode_text = encode_text or text_encoder(tokenizer)

    def token_ids(conversation, add_generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return encode_text(text)

    full = token_ids(messages, add_generation_prompt=False)
    loss_mask = np.zeros(len(full), dtype=bool)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant" or turn < first_trained_turn:
            continue
        start = _common_prefix_length(token_ids(messages[:turn], add_generation_prompt=True), full)
        last = turn == len(messages) - 1
        end = len(full) if last else _common_prefix_length(token_ids(messages[: turn + 1], False), full)
        loss_mask[start:end] = True
    return EncodedExample(np.asarray(full, dtype=np.int32), loss_mask)


def encode_pair(tokenizer, row: dict[str, Any], columns: Sequence[str],
                encode_text: Callable[[str], list[int]] | None = None) -> EncodedPair:
    """Both conversations of a preference row, each trained on its answer only."""
    prompt, chosen, rejected = to_preference_messages(row, columns)
    if not any(m["role"] == "assistant" for m in chosen + rejected):
        raise DataError("the chosen and rejected answers must be assistant messages")
    return EncodedPair(*(encode_conversation(tokenizer, prompt + answer, encode_text, first_trained_turn=len(prompt))
                         for answer in (chosen, rejected)))


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = min(len(a), len(b))
    mismatches = np.nonzero(np.asarray(a[:length]) != np.asarray(b[:length]))[0]
    return int(mismatches[0]) if mismatches.size else length


# ---------------------------------------------------------------- packing


@dataclass(frozen=True)
class PackingOptions:
    seq_len: int
    packing: bool = True
    shuffle: bool = True
    seed: int = 0
    on_end: OnDataEnd = "continue"


def empty_rows(num_rows: int, seq_len: int) -> dict[str, np.ndarray]:
    """Rows of padding: segment id 0 marks padding; weights 0 exclude it from the loss."""
    return {
        "inputs": np.zeros((num_rows, seq_len), np.int32),
        "targets": np.zeros((num_rows, seq_len), np.int32),
        "weights": np.zeros((num_rows, seq_len), np.float32),
        "segment_ids": np.zeros((num_rows, seq_len), np.int32),
        "positions": np.zeros((num_rows, seq_len), np.int32),
    }


class PackedRows:
    """Packs examples into this process's rows of the global batch, resumably.

    `row_ids` are the global indices (in [0, total_rows)) of the rows this process fills;
    `positions[i]` counts the examples row `row_ids[i]` has consumed so far.
    """

    def __init__(
        self,
        num_examples: int,
        encode: Callable[[int], EncodedExample],
        row_ids: Sequence[int],
        total_rows: int,
        options: PackingOptions,
    ):
        if not all(0 <= row < total_rows for row in row_ids):
            raise ValueError(f"row ids must lie in [0, {total_rows})")
        self.num_examples = num_examples
        self.encode = encode
        self.row_ids = np.asarray(row_ids, dtype=np.int64)
        self.total_rows = total_rows
        self.options = options
        self.positions = np.zeros(len(row_ids), dtype=np.int64)
        self._orders: dict[int, np.ndarray] = {}
        self._epoch_seen = 0

    # State.
    def state(self) -> np.ndarray:
        return self.positions.copy()

    def restore(self, positions: np.ndarray) -> None:
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if positions.shape != self.positions.shape:
            raise ValueError(f"data state has {positions.shape[0]} rows, this process reads {len(self.positions)}")
        self.positions = positions.copy()
        self._epoch_seen = max(self._epoch_seen, int(self._epoch_of(self.positions).max(initial=0)))

    # Iteration.
    def next_rows(self, step: int) -> dict[str, np.ndarray]:
        """One batch worth of this process's rows, `[len(row_ids), seq_len]` each."""
        batch = empty_rows(len(self.row_ids), self.options.seq_len)
        for index in range(len(self.row_ids)):
            self._fill_row(index, batch, step)
        return batch

    def _fill_row(self, index: int, batch: dict[str, np.ndarray], step: int) -> None:
        seq_len = self.options.seq_len
        used = 0
        segment = 0
        while used < seq_len:
            stream_position = self._stream_position(index)
            epoch = stream_position // self.num_examples
            if self._data_ended(epoch, step, first=segment == 0):
                return
            example = self.encode(self._example_index(stream_position))
            length = min(len(example.tokens) - 1, seq_len)
            if length <= 0:
                self.positions[index] += 1
                continue
            if segment > 0 and length > seq_len - used:
                return
            self._note_epoch(epoch, step)
            segment += 1
            place(batch, index, used, example, length, segment)
            used += length
            self.positions[index] += 1
            if not self.options.packing:
                return

    def _stream_position(self, index: int) -> int:
        return int(self.positions[index]) * self.total_rows + int(self.row_ids[index])

    def _data_ended(self, epoch: int, step: int, first: bool) -> bool:
        """Whether reading stops at `epoch` (on_end other than continue); DataExhausted for on_end fail when the row
        holds nothing yet (`first`)."""
        if epoch == 0 or self.options.on_end == "continue":
            return False
        if self.options.on_end == "fail" and first:
            raise DataExhausted(
                f"training data exhausted at step {step}: all {self.num_examples} examples were used and "
                f"epoch_policy=fail"
            )
        return True

    def _example_index(self, stream_position: int) -> int:
        epoch, offset = divmod(stream_position, self.num_examples)
        if not self.options.shuffle:
            return offset
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.options.seed, epoch]).permutation(self.num_examples)
            self._orders = {epoch: order, **{e: o for e, o in self._orders.items() if e == epoch - 1}}
        return int(order[offset])

    def _epoch_of(self, positions: np.ndarray) -> np.ndarray:
        return (positions * self.total_rows + self.row_ids) // self.num_examples

    def _note_epoch(self, epoch: int, step: int) -> None:
        if epoch > self._epoch_seen:
            self._epoch_seen = epoch
            log.info("data: starting epoch %d at step %d (%d examples per epoch)", epoch + 1, step, self.num_examples)


def place(batch: dict[str, np.ndarray], row: int, start: int, example: EncodedExample, length: int,
          segment: int) -> None:
    """Write the first `length` positions of `example` into `batch`'s `row` from `start`, as segment `segment`."""
    span = slice(start, start + length)
    batch["inputs"][row, span] = example.tokens[:length]
    batch["targets"][row, span] = example.tokens[1 : length + 1]
    batch["weights"][row, span] = example.loss_mask[1 : length + 1]
    batch["segment_ids"][row, span] = segment
    batch["positions"][row, span] = np.arange(length)


class PairedRows(PackedRows):
    """Preference pairs (`EncodedPair`s) in this process's rows of the global batch, resumably: the pair in slot p
    fills rows 2p (chosen) and 2p+1 (rejected), one conversation per row, never packed, truncated to seq_len from
    the end (the start is kept, as TRL's keep_start). Slot p reads the examples at positions p, p+P, p+2P, ... of the
    epochs' sequence (P pair slots in all), as a `PackedRows` row does; `state()` gives each row its slot's count, so
    the data feed keeps one integer per row."""

    def __init__(
        self,
        num_examples: int,
        encode: Callable[[int], EncodedPair],
        row_ids: Sequence[int],
        total_rows: int,
        options: PackingOptions,
    ):
        rows = np.asarray(row_ids, dtype=np.int64)
        if len(rows) % 2 or np.any(rows[0::2] % 2) or np.any(rows[1::2] != rows[0::2] + 1):
            raise ValueError("a preference pair's two rows must be read together: give each process whole pairs")
        super().__init__(num_examples, encode, rows[0::2] // 2, total_rows // 2, options)

    def state(self) -> np.ndarray:
        return np.repeat(self.positions, 2)

    def restore(self, positions: np.ndarray) -> None:
        super().restore(np.asarray(positions, dtype=np.int64).reshape(-1)[0::2])

    def next_rows(self, step: int) -> dict[str, np.ndarray]:
        batch = empty_rows(2 * len(self.row_ids), self.options.seq_len)
        for index in range(len(self.row_ids)):
            self._fill_pair(index, batch, step)
        return batch

    def _fill_pair(self, index: int, batch: dict[str, np.ndarray], step: int) -> None:
        while True:
            stream_position = self._stream_position(index)
            epoch = stream_position // self.num_examples
            if self._data_ended(epoch, step, first=True):
                return
            pair = self.encode(self._example_index(stream_position))
            self.positions[index] += 1
            lengths = [min(len(example.tokens) - 1, self.options.seq_len) for example in (pair.chosen, pair.rejected)]
            if min(lengths) > 0:
                break
        self._note_epoch(epoch, step)
        for offset, (example, length) in enumerate(zip((pair.chosen, pair.rejected), lengths, strict=True)):
            place(batch, 2 * index + offset, 0, example, length, segment=1)


class PrefetchedRows:
    """A PackedRows whose next `depth` batches are prepared by a background thread.

    Reading, rendering, tokenizing and packing then overlap the device step instead of
    following it. `state()` is the packer's state after the last batch handed out, not after
    the batches prepared ahead, so a checkpoint records exactly what training consumed. A
    failure while preparing a batch is raised when that batch is asked for, so its message
    names the step it belongs to.
    """

    def __init__(self, packer: PackedRows, depth: int = 2):
        if depth < 1:
            raise ValueError("prefetch depth must be at least 1")
        self.packer = packer
        self.depth = depth
        self._consumed = packer.state()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def state(self) -> np.ndarray:
        return self._consumed.copy()

    def restore(self, positions: np.ndarray) -> None:
        if self._thread is not None:
            raise RuntimeError("the data state can only be restored before the first batch")
        self.packer.restore(positions)
        self._consumed = self.packer.state()

    def next_rows(self, step: int) -> dict[str, np.ndarray]:
        if self._thread is None:
            self._start(step)
        prepared_step, rows, state, error = self._take(step)
        if error is not None:
            raise error
        if prepared_step != step:
            raise RuntimeError(f"asked for the batch of step {step}, the next prepared one is step {prepared_step}")
        self._consumed = state
        return rows

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _start(self, first_step: int) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._prepare, args=(first_step,), name="data-prefetch", daemon=True)
        self._thread.start()

    def _take(self, step: int) -> tuple:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise DataError(f"the data prefetch thread stopped before preparing step {step}") from None

    def _prepare(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = (step, self.packer.next_rows(step), self.packer.state(), None)
            except BaseException as error:  # noqa: BLE001 - handed to the training loop, which names the step
                item = (step, None, None, error)
            if not self._put(item) or item[3] is not None:
                return
            step += 1

    def _put(self, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


def make_encoder(
    dataset, tokenizer, columns: Sequence[str], cache_tokens: int = ENCODED_CACHE_TOKENS
) -> Callable[[int], EncodedExample | EncodedPair]:
    """Example index -> encoded example (an `EncodedPair` for a preference layout), reading the dataset row on demand.

    Encoded examples are kept (least recently used first out) up to `cache_tokens` tokens, so a
    later epoch or a repeated evaluation does not render and tokenize them again.
    """
    encode_text = text_encoder(tokenizer)
    preference = tuple(columns) in PREFERENCE_COLUMN_LAYOUTS
    cache: OrderedDict[int, EncodedExample | EncodedPair] = OrderedDict()
    cached_tokens = 0

    def encode_row(row: dict[str, Any]) -> EncodedExample | EncodedPair:
        if preference:
            return encode_pair(tokenizer, row, columns, encode_text)
        return encode_conversation(tokenizer, to_messages(row, columns), encode_text)

    def encode(index: int) -> EncodedExample | EncodedPair:
        nonlocal cached_tokens
        if index in cache:
            cache.move_to_end(index)
            return cache[index]
        try:
            example = encode_row(dataset[index])
        except DataError as error:
            raise DataError(f"example {index}: {error}") from None
        cache[index] = example
        cached_tokens += example.size
        while cached_tokens > cache_tokens:
            cached_tokens -= cache.popitem(last=False)[1].size
        return example

    return encode
