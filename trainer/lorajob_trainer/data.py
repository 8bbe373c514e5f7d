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

if TYPE_CHECKING:
    from lorajob_trainer.contract.config import TrainConfig

log = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

ENCODED_CACHE_TOKENS = 1 << 24
"""Default budget of the encoded-example cache: 16M tokens, about 80 MB (int32 ids + bool mask)."""

OnDataEnd = Literal["continue", "fail", "pad"]
"""continue: start the next epoch; fail: raise DataExhausted; pad: emit empty rows (evaluation)."""


class DataError(ValueError):
    """The dataset, its columns or the chat template cannot be used."""


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


def to_messages(row: dict[str, Any], columns: Sequence[str]) -> list[dict[str, str]]:
    """Turn one dataset row in any supported column layout into a chat message list."""
    if tuple(columns) == ("messages",):
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DataError("column 'messages' must hold a list of {role, content} dicts")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt_column, answer_column = columns
    return [
        {"role": "user", "content": str(row[prompt_column])},
        {"role": "assistant", "content": str(row[answer_column])},
    ]


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
    tokenizer, messages: list[dict[str, str]], encode_text: Callable[[str], list[int]] | None = None
) -> EncodedExample:
    """Token ids of the conversation and a mask that is true on assistant tokens only."""
    if not any(m["role"] == "assistant" for m in messages):
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
        if message["role"] != "assistant":
            continue
        start = _common_prefix_length(token_ids(messages[:turn], add_generation_prompt=True), full)
        last = turn == len(messages) - 1
        end = len(full) if last else _common_prefix_length(token_ids(messages[: turn + 1], False), full)
        loss_mask[start:end] = True
    return EncodedExample(np.asarray(full, dtype=np.int32), loss_mask)


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
            stream_position = int(self.positions[index]) * self.total_rows + int(self.row_ids[index])
            epoch = stream_position // self.num_examples
            if epoch > 0 and self.options.on_end != "continue":
                if self.options.on_end == "fail" and segment == 0:
                    raise DataExhausted(
                        f"training data exhausted at step {step}: all {self.num_examples} examples were used "
                        f"and epoch_policy=fail"
                    )
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
            span = slice(used, used + length)
            batch["inputs"][index, span] = example.tokens[:length]
            batch["targets"][index, span] = example.tokens[1 : length + 1]
            batch["weights"][index, span] = example.loss_mask[1 : length + 1]
            batch["segment_ids"][index, span] = segment
            batch["positions"][index, span] = np.arange(length)
            used += length
            self.positions[index] += 1
            if not self.options.packing:
                return

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
) -> Callable[[int], EncodedExample]:
    """Example index -> encoded example, reading the dataset row on demand.

    Encoded examples are kept (least recently used first out) up to `cache_tokens` tokens, so a
    later epoch or a repeated evaluation does not render and tokenize them again.
    """
    encode_text = text_encoder(tokenizer)
    cache: OrderedDict[int, EncodedExample] = OrderedDict()
    cached_tokens = 0

    def encode(index: int) -> EncodedExample:
        nonlocal cached_tokens
        if index in cache:
            cache.move_to_end(index)
            return cache[index]
        try:
            example = encode_conversation(tokenizer, to_messages(dataset[index], columns), encode_text)
        except DataError as error:
            raise DataError(f"example {index}: {error}") from None
        cache[index] = example
        cached_tokens += len(example.tokens)
        while cached_tokens > cache_tokens:
            cached_tokens -= len(cache.popitem(last=False)[1].tokens)
        return example

    return encode
