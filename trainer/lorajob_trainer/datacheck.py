"""Check a run's data on a CPU before any accelerator is held:

    python -m lorajob_trainer.datacheck --devices N [config.yaml] KEY=VALUE...

It takes the train step's own config (so it reads exactly what training will read), loads the tokenizer and
the dataset, checks the columns, renders the chat template for every example, and reports how many examples
and tokens there are, how many epochs `steps` x global batch amounts to and what share of the trained tokens
`max_target_length` cuts off. Bad data exits with the trainer's DATA code and a message saying what is wrong.
The operator runs it first in the convert step, so a LoRAJob with broken data fails before it asks Kueue
for TPUs or GPUs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

from lorajob_trainer import data as data_lib
from lorajob_trainer import loading, models
from lorajob_trainer.contract import exit_codes
from lorajob_trainer.contract.config import TrainConfig, parse_or_report
from lorajob_trainer.console import configure_logging
from lorajob_trainer.contract.records import DataRecord
from lorajob_trainer.contract.environment import missing_credentials

log = logging.getLogger("lorajob_trainer.datacheck")  # not __name__: run as __main__


@dataclass(frozen=True)
class DataReport:
    examples: int
    tokens: int
    trained_tokens: int
    """Tokens the loss is computed on (the answers), before truncation."""
    truncated_examples: int
    """Examples longer than max_target_length (a preference pair: either of its conversations)."""
    truncated_trained_tokens: int
    rows_per_epoch: int
    """Rows of max_target_length one pass over the data fills (packing as the trainer packs, in data order)."""
    rows_per_step: int

    @property
    def epochs(self) -> float:
        return self.rows_per_step / self.rows_per_epoch if self.rows_per_epoch else 0.0

    @property
    def truncated_share(self) -> float:
        return self.truncated_trained_tokens / self.trained_tokens if self.trained_tokens else 0.0

    def describe(self, steps: int) -> str:
        return (f"{self.examples:,} examples, {self.tokens:,} tokens ({self.trained_tokens:,} trained); "
                f"{steps:,} steps x {self.rows_per_step:,} rows = {steps * self.epochs:.2f} epochs; "
                f"{self.truncated_examples:,} examples longer than max_target_length lose "
                f"{100 * self.truncated_share:.1f}% of the trained tokens")

    def record(self, steps: int) -> DataRecord:
        """The figures as the operator reads them (status.data), from the line `main` prints."""
        return DataRecord(
            examples=self.examples, tokens=self.tokens, trained_tokens=self.trained_tokens, epochs=steps * self.epochs,
            truncated_examples=self.truncated_examples, truncated_share=self.truncated_share,
        )


def _rows(lengths: list[int], seq_len: int, packing: bool) -> int:
    """Rows the trainer's greedy packing fills with examples of these lengths (each cut to seq_len)."""
    if not packing:
        return len(lengths)
    rows, used = 0, seq_len
    for length in (min(length, seq_len) for length in lengths if length > 0):
        if used + length > seq_len:
            rows, used = rows + 1, 0
        used += length
    return rows


def check(config: TrainConfig, devices: int) -> DataReport:
    """DataError when the data cannot be trained on; the figures otherwise."""
    tokenizer = data_lib.load_tokenizer(str(loading.local_config_directory(config.tokenizer_directory)),
                                        config.chat_template_path)
    dataset = data_lib.load_dataset_split(data_lib.train_source(config), config.train_data_columns)
    if len(dataset) == 0:
        raise data_lib.DataError("the training split has no examples")
    encode = data_lib.make_encoder(dataset, tokenizer, config.train_data_columns, cache_tokens=0)
    seq_len = config.max_target_length
    lengths, tokens, trained, truncated, truncated_trained = [], 0, 0, 0, 0
    for index in range(len(dataset)):
        encoded = encode(index)
        sequences = (encoded.chosen, encoded.rejected) if isinstance(encoded, data_lib.EncodedPair) else (encoded,)
        if any(len(example.tokens) - 1 > seq_len for example in sequences):
            truncated += 1
        for example in sequences:
            targets = example.loss_mask[1:]
            lengths.append(len(example.tokens) - 1)
            tokens += len(example.tokens)
            trained += int(targets.sum())
            truncated_trained += int(targets[seq_len:].sum())
    if trained == 0:
        raise data_lib.DataError("no example has an answer token to train on")
    return DataReport(
        examples=len(dataset), tokens=tokens, trained_tokens=trained, truncated_examples=truncated,
        truncated_trained_tokens=truncated_trained,
        rows_per_epoch=_rows(lengths, seq_len, config.packing and not config.preference_method),
        rows_per_step=config.rows_per_device * devices * config.gradient_accumulation_steps,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1, help="accelerators of the train step (the global batch)")
    parser.add_argument("config", nargs="*", help="the train step's [config.yaml] KEY=VALUE... (see train --help)")
    args = parser.parse_args(argv)
    configure_logging()
    config = parse_or_report(args.config)
    if config is None:
        return exit_codes.CONFIG
    missing = missing_credentials(os.environ)
    if missing:
        print(f"config error: {missing}", file=sys.stderr)
        return exit_codes.CONFIG
    try:
        report = check(config, args.devices)
    except data_lib.DataError as error:
        print(f"data check failed: {error}", file=sys.stderr)
        return exit_codes.DATA
    except models.ModelConfigError as error:
        print(f"data check failed: the tokenizer cannot be loaded: {error}", file=sys.stderr)
        return exit_codes.MODEL
    log.info("data check passed: %s", report.describe(config.steps))
    print(report.record(config.steps).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
