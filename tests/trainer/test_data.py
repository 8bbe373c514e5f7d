"""Data pipeline: column layouts, chat templates, answer-only loss masks, packing, sharding, resume."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
from trainer_testkit import arithmetic_rows, write_jsonl

from lorajob_trainer import data
from lorajob_trainer.data import DataError, DataExhausted, DataSource, EncodedExample, PackedRows, PackingOptions


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from lorajob_trainer import tiny

    directory = tiny.write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return data.load_tokenizer(str(directory))


def trained_text(tokenizer, example: EncodedExample) -> str:
    """The decoded trained tokens, without the spaces the tiny tokenizer's decoder inserts."""
    return tokenizer.decode(example.tokens[example.loss_mask]).replace(" ", "")


# ---------------------------------------------------------------- formatting and masking


@pytest.mark.parametrize(
    ("row", "columns"),
    [
        pytest.param({"question": "what is 2 plus 3?", "answer": "5"}, ["question", "answer"], id="question-answer"),
        pytest.param({"prompt": "what is 2 plus 3?", "completion": "5"}, ["prompt", "completion"], id="prompt-completion"),
        pytest.param(
            {"messages": [{"role": "user", "content": "what is 2 plus 3?"}, {"role": "assistant", "content": "5"}]},
            ["messages"],
            id="messages",
        ),
    ],
)
def test_every_layout_trains_only_on_the_answer(tokenizer, row, columns):
    example = data.encode_conversation(tokenizer, data.to_messages(row, columns))
    assert trained_text(tokenizer, example).startswith("5<|im_end|>")
    prompt_text = tokenizer.decode(example.tokens[~example.loss_mask]).replace(" ", "")
    assert "whatis2plus3?" in prompt_text and "<|im_start|>assistant" in prompt_text
    # The mask is one contiguous span at the end: header and prompt come first.
    first = int(np.argmax(example.loss_mask))
    assert example.loss_mask[first:].all() and not example.loss_mask[:first].any()


def test_multi_turn_masks_every_assistant_turn_and_nothing_else(tokenizer):
    messages = [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": "what is 1 plus 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 2 plus 2?"},
        {"role": "assistant", "content": "4"},
    ]
    example = data.encode_conversation(tokenizer, messages)
    spans = np.flatnonzero(np.diff(np.concatenate([[0], example.loss_mask.astype(int), [0]])))
    assert len(spans) == 4, "two separate trained spans, one per assistant turn"
    texts = [tokenizer.decode(example.tokens[a:b]).replace(" ", "") for a, b in zip(spans[::2], spans[1::2])]
    assert texts[0].startswith("2<|im_end|>") and texts[1].startswith("4<|im_end|>")


def test_text_encoder_gives_the_tokenizers_own_ids(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 12 plus 30?"}, {"role": "assistant", "content": "42"}], tokenize=False
    )
    assert data.text_encoder(tokenizer)(text) == tokenizer(text, add_special_tokens=False)["input_ids"]


class CountingRows(list):
    """Dataset rows that count how often each is read."""

    def __init__(self, rows):
        super().__init__(rows)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_encoded_examples_are_cached_within_the_token_budget(tokenizer):
    rows = CountingRows(arithmetic_rows(3))
    encode = data.make_encoder(rows, tokenizer, ["question", "answer"])
    first = encode(1)
    assert encode(1) is first and rows.reads == 1, "a cached example is not read or encoded again"
    tight = CountingRows(arithmetic_rows(3))
    encode = data.make_encoder(tight, tokenizer, ["question", "answer"], cache_tokens=len(first.tokens))
    encode(0), encode(1), encode(0)
    assert tight.reads == 3, "over the budget, the least recently used example is dropped"


def test_conversation_without_assistant_is_rejected(tokenizer):
    with pytest.raises(DataError, match="no assistant message"):
        data.encode_conversation(tokenizer, [{"role": "user", "content": "hi"}])


def test_messages_column_must_hold_role_dicts():
    with pytest.raises(DataError, match="messages"):
        data.to_messages({"messages": "just text"}, ["messages"])


# ---------------------------------------------------------------- chat templates


ALT_TEMPLATE = (
    "{% for m in messages %}{{ '<bos>' + m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<bos>assistant: ' }}{% endif %}"
)


@pytest.mark.parametrize("suffix", [".jinja", ".json"])
def test_chat_template_file_replaces_the_tokenizers(tmp_path, suffix):
    from lorajob_trainer import tiny

    template_file = tmp_path / f"template{suffix}"
    template_file.write_text(json.dumps({"chat_template": ALT_TEMPLATE}) if suffix == ".json" else ALT_TEMPLATE)
    tokenizer = data.load_tokenizer(str(tiny.write_tiny_tokenizer(tmp_path / "tok")), str(template_file))
    example = data.encode_conversation(tokenizer, data.to_messages({"question": "q", "answer": "7"}, ["question", "answer"]))
    assert "<|im_start|>" not in tokenizer.decode(example.tokens)
    assert trained_text(tokenizer, example) == "7<|im_end|>"


def test_template_errors_are_specific(tmp_path):
    from lorajob_trainer import tiny

    directory = str(tiny.write_tiny_tokenizer(tmp_path / "tok"))
    with pytest.raises(DataError, match="does not exist"):
        data.load_tokenizer(directory, str(tmp_path / "absent.jinja"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"template": "x"}))
    with pytest.raises(DataError, match="chat_template"):
        data.load_tokenizer(directory, str(bad))
    config_path = tmp_path / "tok" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(DataError, match="no chat template"):
        data.load_tokenizer(directory)


# ---------------------------------------------------------------- loading


def test_local_files_and_directories_load(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", arithmetic_rows(3))
    write_jsonl(tmp_path / "d" / "sub" / "b.jsonl", arithmetic_rows(2, seed=1))
    dataset = data.load_dataset_split(DataSource(files=(str(tmp_path / "d"),)), ["question", "answer"])
    assert len(dataset) == 5


def test_loading_errors_name_the_problem(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", arithmetic_rows(3))
    with pytest.raises(DataError, match=r"lacks column\(s\) \['messages'\]"):
        data.load_dataset_split(DataSource(files=(str(tmp_path / "a.jsonl"),)), ["messages"])
    with pytest.raises(DataError, match="does not exist"):
        data.load_dataset_split(DataSource(files=(str(tmp_path / "nope.jsonl"),)), ["messages"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no"):
        data.load_dataset_split(DataSource(files=(str(tmp_path / "empty"),)), ["messages"])


# ---------------------------------------------------------------- packing


def synthetic_encoder(lengths: list[int]):
    """Example i: tokens 1000*i + [0..n), loss on its second half."""

    def encode(index: int) -> EncodedExample:
        n = lengths[index]
        mask = np.zeros(n, dtype=bool)
        mask[n // 2 :] = True
        return EncodedExample(np.arange(n, dtype=np.int32) + 1000 * index, mask)

    return encode


def packer(lengths, row_ids=(0,), total_rows=1, **options) -> PackedRows:
    defaults = {"seq_len": 16, "packing": True, "shuffle": False}
    return PackedRows(len(lengths), synthetic_encoder(lengths), list(row_ids), total_rows, PackingOptions(**defaults | options))


def test_packed_row_layout():
    rows = packer([5, 7, 9, 3]).next_rows(step=1)
    # Examples 0 (4 inputs) and 1 (6 inputs) fit in 16; example 2 (8 inputs) does not, so it starts the next row.
    np.testing.assert_array_equal(rows["segment_ids"][0], [1] * 4 + [2] * 6 + [0] * 6)
    np.testing.assert_array_equal(rows["positions"][0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5] + [0] * 6)
    np.testing.assert_array_equal(rows["inputs"][0, :10], [0, 1, 2, 3, 1000, 1001, 1002, 1003, 1004, 1005])
    # Targets are the next token of the same example: never the first token of the next segment.
    np.testing.assert_array_equal(rows["targets"][0, :10], [1, 2, 3, 4, 1001, 1002, 1003, 1004, 1005, 1006])
    # Loss on the second half of each example's tokens (shifted by one for next-token targets), never on padding.
    np.testing.assert_array_equal(rows["weights"][0], [0, 1, 1, 1, 0, 0, 1, 1, 1, 1] + [0] * 6)


def test_without_packing_each_row_holds_one_truncated_example():
    p = packer([5, 40], packing=False)
    first, second = p.next_rows(step=1), p.next_rows(step=2)
    assert set(first["segment_ids"][0]) == {0, 1} and first["segment_ids"][0].sum() == 4
    assert (second["segment_ids"][0] == 1).all(), "a 40-token example is truncated to the 16-token row"
    np.testing.assert_array_equal(second["targets"][0], np.arange(1, 17) + 1000)


def test_rows_do_not_depend_on_the_number_of_processes():
    lengths = [3 + (i * 7) % 11 for i in range(50)]
    whole = packer(lengths, row_ids=range(4), total_rows=4, shuffle=True, seed=3)
    halves = [packer(lengths, row_ids=ids, total_rows=4, shuffle=True, seed=3) for ids in ([0, 1], [2, 3])]
    for step in range(1, 8):
        expected = whole.next_rows(step)
        parts = [half.next_rows(step) for half in halves]
        for name in expected:
            np.testing.assert_array_equal(expected[name], np.concatenate([part[name] for part in parts]))


def test_resume_neither_replays_nor_skips():
    lengths = [3 + (i * 5) % 9 for i in range(40)]
    uninterrupted = packer(lengths, row_ids=range(3), total_rows=3, shuffle=True)
    first = packer(lengths, row_ids=range(3), total_rows=3, shuffle=True)
    for step in range(1, 4):
        np.testing.assert_array_equal(first.next_rows(step)["inputs"], uninterrupted.next_rows(step)["inputs"])
    resumed = packer(lengths, row_ids=range(3), total_rows=3, shuffle=True)
    resumed.restore(first.state())
    for step in range(4, 12):
        np.testing.assert_array_equal(resumed.next_rows(step)["inputs"], uninterrupted.next_rows(step)["inputs"])


def test_one_epoch_uses_every_example_exactly_once():
    lengths = [4] * 30
    p = packer(lengths, row_ids=range(3), total_rows=3, shuffle=True, seq_len=5)  # one example per row
    seen = []
    for step in range(1, 11):
        seen.extend((p.next_rows(step)["inputs"][:, 0] // 1000).tolist())
    assert sorted(seen) == list(range(30))


def test_end_of_data_continues_into_next_epoch_and_logs_it(caplog):
    p = packer([4] * 3, seq_len=5, on_end="continue")
    with caplog.at_level(logging.INFO, logger="lorajob_trainer.data"):
        batches = [p.next_rows(step) for step in range(1, 6)]
    assert all(batch["segment_ids"].any() for batch in batches)
    assert "starting epoch 2 at step 4" in caplog.text


def test_end_of_data_fails_when_epochs_are_not_allowed():
    p = packer([4] * 3, seq_len=5, on_end="fail")
    for step in range(1, 4):
        p.next_rows(step)
    with pytest.raises(DataExhausted, match="exhausted at step 4"):
        p.next_rows(4)


def test_evaluation_rows_pad_after_the_data_ends():
    p = packer([4] * 3, row_ids=range(2), total_rows=2, seq_len=5, on_end="pad")
    p.next_rows(1)
    second = p.next_rows(2)
    assert second["segment_ids"][0].any() and not second["segment_ids"][1].any()
    assert not p.next_rows(3)["segment_ids"].any()


def test_restore_rejects_a_state_of_another_shape():
    with pytest.raises(ValueError, match="data state has 2 rows"):
        packer([4] * 3).restore(np.zeros(2, dtype=np.int64))


# ---------------------------------------------------------------- prefetching


def prefetched(lengths, **options) -> data.PrefetchedRows:
    return data.PrefetchedRows(packer(lengths, row_ids=range(2), total_rows=2, shuffle=True, **options), depth=2)


def wait_until_prepared_ahead(rows: data.PrefetchedRows, steps_consumed: int, synchronous: PackedRows) -> None:
    """Block until the background thread has packed past what was consumed."""
    reference = packer_state_after(synchronous, steps_consumed)
    for _ in range(500):
        if (rows.packer.state() != reference).any():
            return
        time.sleep(0.01)
    raise AssertionError("the prefetch thread never got ahead")


def packer_state_after(p: PackedRows, steps: int) -> np.ndarray:
    for step in range(1, steps + 1):
        p.next_rows(step)
    return p.state()


LENGTHS = [3 + (i * 5) % 9 for i in range(40)]


def test_prefetched_batches_are_the_synchronous_ones():
    synchronous = packer(LENGTHS, row_ids=range(2), total_rows=2, shuffle=True)
    rows = prefetched(LENGTHS)
    try:
        for step in range(1, 15):
            expected, got = synchronous.next_rows(step), rows.next_rows(step)
            for name in expected:
                np.testing.assert_array_equal(got[name], expected[name])
    finally:
        rows.close()


def test_prefetched_state_is_that_of_the_consumed_batch_and_resumes_exactly():
    rows = prefetched(LENGTHS)
    try:
        for step in range(1, 4):
            rows.next_rows(step)
        wait_until_prepared_ahead(rows, 3, packer(LENGTHS, row_ids=range(2), total_rows=2, shuffle=True))
        consumed = rows.state()
    finally:
        rows.close()
    np.testing.assert_array_equal(
        consumed, packer_state_after(packer(LENGTHS, row_ids=range(2), total_rows=2, shuffle=True), 3)
    )
    uninterrupted = packer(LENGTHS, row_ids=range(2), total_rows=2, shuffle=True)
    packer_state_after(uninterrupted, 3)
    resumed = prefetched(LENGTHS)
    resumed.restore(consumed)
    try:
        for step in range(4, 10):
            np.testing.assert_array_equal(resumed.next_rows(step)["inputs"], uninterrupted.next_rows(step)["inputs"])
    finally:
        resumed.close()


def test_prefetched_failure_is_raised_at_its_own_step():
    rows = data.PrefetchedRows(packer([4] * 3, seq_len=5, on_end="fail"), depth=2)
    try:
        for step in range(1, 4):
            assert rows.next_rows(step)["segment_ids"].any()
        with pytest.raises(DataExhausted, match="exhausted at step 4"):
            rows.next_rows(4)
    finally:
        rows.close()


def test_an_encoding_error_ahead_does_not_cut_the_batches_before_it():
    def encode(index: int) -> EncodedExample:
        if index == 5:
            raise DataError("example 5: broken")
        return synthetic_encoder([4] * 10)(index)

    rows = data.PrefetchedRows(PackedRows(10, encode, [0], 1, PackingOptions(seq_len=5, packing=False, shuffle=False)), depth=3)
    try:
        for step in range(1, 6):
            rows.next_rows(step)
        with pytest.raises(DataError, match="example 5"):
            rows.next_rows(6)
    finally:
        rows.close()


def test_close_stops_the_thread_and_restore_after_start_is_refused():
    rows = prefetched(LENGTHS)
    rows.next_rows(1)
    with pytest.raises(RuntimeError, match="before the first batch"):
        rows.restore(rows.state())
    rows.close()
    assert not rows._thread.is_alive()
