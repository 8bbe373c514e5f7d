"""A person at a terminal sees a progress bar (step, loss, tokens/s, ETA) with the log lines above it; a pipe
or a pod's log sees the plain log lines only."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import struct
import subprocess
import sys
import termios
import uuid

from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, trainer_env, write_jsonl

from lorajob_trainer.console import ConsoleProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_with_step_loss_throughput_and_eta_and_the_log_lines_above_it():
    terminal = Terminal()
    logger = logging.getLogger("lorajob_trainer.test_console")
    package = logging.getLogger("lorajob_trainer")
    handler = logging.StreamHandler(terminal)
    package.addHandler(handler)
    try:
        with ConsoleProgress(10, 2, enabled=True, stream=terminal) as console:
            console.update(3, loss=1.23456, tokens_per_second=4321.0)
            logger.warning("step 3 of 10")
            console.update(4, loss=1.1, tokens_per_second=4400.0)
    finally:
        package.removeHandler(handler)
    text = terminal.getvalue()
    assert "step 3 of 10\n" in text
    assert re.search(r"train: +40%.*\| 4/10 \[.*<.*, loss 1\.1000, 4,400 tok/s\]", text), text


def test_a_pipe_or_the_operators_pods_get_no_bar():
    pipe, terminal = io.StringIO(), Terminal()
    for stream, enabled in ((pipe, True), (terminal, False)):
        with ConsoleProgress(10, 0, enabled=enabled, stream=stream) as console:
            console.update(1, loss=1.0, tokens_per_second=1.0)
        assert stream.getvalue() == ""


def test_the_trainer_at_a_terminal_draws_the_bar_and_no_output_holds_the_token(tmp_path):
    """One real run at a terminal; the Hugging Face token in its environment reaches no log line, checkpoint
    or exported file, nor the error of a conversion that hands it to the Hub client (a download that fails:
    the Hub is offline here)."""
    token = "hf_" + uuid.uuid4().hex
    env = {**trainer_env(devices=1), "HF_TOKEN": token}
    model_dir = tiny_checkpoint(tmp_path / "model")
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(64))
    arguments = base_args(model_dir, tmp_path / "out", train_file, "steps=4", "enable_tensorboard=False")
    command = [sys.executable, "-m", "lorajob_trainer.train", *arguments]
    controller, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a new pty has 0 columns
    process = subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closes when the trainer exits
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert process.wait(timeout=600) == 0, output.decode(errors="replace")[-3000:]
    text = output.decode(errors="replace")
    assert re.search(r"train: 100%.*\| 4/4 \[.*, loss \d+\.\d{4}, [\d,]+ tok/s\]", text), text[-3000:]
    assert re.search(r"step 4/4 loss \d+\.\d{4}", text)

    exported = subprocess.run([sys.executable, "-m", "lorajob_trainer.export", "--checkpoint",
                               str(tmp_path / "out" / "run" / "checkpoints"), "--out", str(tmp_path / "adapter")],
                              capture_output=True, env=env, timeout=600)
    assert exported.returncode == 0, exported.stderr[-3000:]
    downloaded = subprocess.run([sys.executable, "-m", "lorajob_trainer.convert", "base", "--model-name", "qwen3-0.6b",
                                 "--hf", "lorajob-tests/no-such-model", "--out", str(tmp_path / "converted")],
                                capture_output=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert downloaded.returncode != 0 and b"lorajob-tests/no-such-model" in downloaded.stderr, downloaded.stderr[-3000:]
    assert token.encode() not in output + exported.stdout + exported.stderr + downloaded.stdout + downloaded.stderr
    written = [path for path in (tmp_path / "out").rglob("*") if path.is_file()] + list((tmp_path / "adapter").rglob("*"))
    assert len(written) > 5 and [path for path in written if path.is_file() and token.encode() in path.read_bytes()] == []


def test_orbax_warnings_our_own_calls_cause_are_left_out_and_others_kept():
    from lorajob_trainer.console import configure_logging

    absl, package, terminal = logging.getLogger("absl"), logging.getLogger("lorajob_trainer"), Terminal()
    handler, package_state = logging.StreamHandler(terminal), (package.handlers, package.level, package.propagate)
    absl.addHandler(handler)
    try:
        configure_logging()
        absl.warning("[process=0] Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs found")
        absl.warning("Item \"lora\" was found in the checkpoint, but could not be restored.")
        absl.warning("a checkpoint write is slow")
    finally:
        absl.removeHandler(handler)
        absl.filters.clear()
        package.handlers, package.propagate = package_state[0], package_state[2]
        package.setLevel(package_state[1])
    assert terminal.getvalue() == "a checkpoint write is slow\n"
