"""Evaluation by generated answers (evaluate.py): the scorers on fixed strings, the record the operator lifts,
the export gate; and a real run whose adapter learns what the base cannot, evaluated after its last step."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, write_jsonl

from lorajob_trainer import data as data_lib
from lorajob_trainer import evaluate, export
from lorajob_trainer.contract import exit_codes
from lorajob_trainer import train as train_lib
from lorajob_trainer.contract.config import ConfigError, TrainConfig
from lorajob_trainer.contract.records import EvalRecord, EvalSample, ExportGate, ModelScore, last_evaluation


@pytest.mark.parametrize("name, pattern, answer, reference, right", [
    ("exact_match", "", "  The Answer is 57. ", "the answer is 57", True),
    ("exact_match", "", "the answer is 58.", "the answer is 57.", False),
    ("exact_match", "", "the answer is 57 and more", "the answer is 57.", False),
    ("contains", "", "Well, THE answer is 57. Done", "the answer is 57.", True),
    ("contains", "", "the answer is 5", "the answer is 57.", False),
    ("regex", r"answer is (\d+)", "so the answer is 57!", "the answer is 57.", True),
    ("regex", r"answer is (\d+)", "so the answer is 56!", "the answer is 57.", False),
    ("regex", r"answer is (\d+)", "fifty-seven", "the answer is 57.", False),
    ("regex", r"\d+", "it is 57", "57", True),
    ("gsm8k", "", "48 + 24 = 72\n#### 72", "She sold 48/2 = 24 clips.\n#### 72", True),
    ("gsm8k", "", "#### 1,200", "#### 1200", True),
    ("gsm8k", "", "#### 72.0", "#### 72", True),
    ("gsm8k", "", "the answer is 72", "#### 72", False),
    ("gsm8k", "", "#### 71", "#### 72", False),
])
def test_scorers(name, pattern, answer, reference, right):
    assert evaluate.scorer(name, pattern)(answer, reference) is right


def test_a_regex_scorer_without_a_pattern_or_with_a_broken_one_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", arithmetic_rows(2))
    args = base_args(tmp_path, tmp_path / "out", data, "steps=1", f"hf_eval_files=['{data}']", "generation_eval.enabled=true")
    with pytest.raises(ConfigError, match="scorer=regex needs generation_eval.pattern"):
        TrainConfig.from_args([*args, "generation_eval.scorer=regex"])
    with pytest.raises(ConfigError, match="not a regex"):
        TrainConfig.from_args([*args, "generation_eval.scorer=regex", "generation_eval.pattern=(unclosed"])
    with pytest.raises(ConfigError, match="needs evaluation data"):
        TrainConfig.from_args(base_args(tmp_path, tmp_path / "out", data, "steps=1", "generation_eval.enabled=true"))


def test_the_stop_tokens_are_eos_and_the_templates_end_of_turn(tmp_path):
    tokenizer = data_lib.load_tokenizer(str(tiny_checkpoint(tmp_path / "model")))
    ids = evaluate.stop_token_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert tokenizer.eos_token_id in ids
    assert tokenizer.convert_tokens_to_ids("<bos>") not in ids


RECORD = EvalRecord(
    scorer="exact_match", examples=40, step=60, max_new_tokens=32, seconds=3.5,
    base=ModelScore(score=0.0, stop_rate=0.1, mean_length=31.0), adapter=ModelScore(score=0.8, stop_rate=1.0, mean_length=6.5),
    samples=(EvalSample("what is 1 plus 2?", "the answer is 3.", "plus plus", "the answer is 3."),),
)


def test_the_record_round_trips_through_its_line_and_a_garbled_one_is_none():
    log = "\n".join(["noise", RECORD.line(), "more noise"])
    assert last_evaluation(log) == RECORD
    assert EvalRecord.from_json(RECORD.to_json()) == RECORD
    assert last_evaluation(RECORD.line()[:-5]) is None
    broken = RECORD.to_json()
    broken["adapter"]["score"] = 1.5
    assert EvalRecord.from_json(broken) is None


def test_the_gate_says_why_with_both_scores():
    assert ExportGate().active is False
    assert ExportGate(require_improvement=True).refusal(RECORD) is None
    worse = replace(RECORD, adapter=ModelScore(score=0.0, stop_rate=0.5, mean_length=10))
    refusal = ExportGate(require_improvement=True, minimum_stop_rate=0.9).refusal(worse)
    assert "does not score above the base model" in refusal and "stop rate is below export.minimumStopRate=0.9" in refusal
    assert "adapter 0.0%, base 0.0%" in refusal and "stop rate adapter 50.0%, base 10.0%" in refusal
    assert ExportGate(minimum_score=0.9).refusal(RECORD) == (
        "the adapter of step 60 is not exported: its score is below export.minimumScore=0.9 (exact_match on 40 "
        "examples: adapter 80.0%, base 0.0%; stop rate adapter 100.0%, base 10.0%)")


def test_a_preference_run_is_gated_on_its_preference_accuracy_not_its_score():
    """RECORD's adapter scores above its base (80 % against 0 %): with preference accuracies the gate compares those."""
    ranked = replace(RECORD, base=replace(RECORD.base, preference_accuracy=0.75),
                     adapter=replace(RECORD.adapter, preference_accuracy=0.75))
    assert EvalRecord.from_json(ranked.to_json()) == ranked
    refusal = ExportGate(require_improvement=True).refusal(ranked)
    assert "its preference accuracy (75.0%) is not above the base model's (75.0%)" in refusal, refusal
    better = replace(ranked, adapter=replace(ranked.adapter, preference_accuracy=0.9, score=0.0))
    assert ExportGate(require_improvement=True).refusal(better) is None
    broken = ranked.to_json()
    broken["base"]["preference_accuracy"] = 1.5
    assert EvalRecord.from_json(broken) is None


STEPS = 40


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A run on "what is a plus b? -> the answer is <sum>." that evaluates by the answer's form after its last step."""
    root = tmp_path_factory.mktemp("evaluated")
    model = tiny_checkpoint(root / "model")
    train_file = write_jsonl(root / "train.jsonl", arithmetic_rows(200))
    eval_file = write_jsonl(root / "eval.jsonl", arithmetic_rows(12, seed=1))
    config = TrainConfig.from_args(base_args(
        model, root / "out", train_file, f"steps={STEPS}", f"hf_eval_files=['{eval_file}']", "checkpoint_period=20",
        "generation_eval.enabled=true", "generation_eval.scorer=regex", "generation_eval.pattern=^(the answer is) \\d+",
        "generation_eval.max_new_tokens=12", "generation_eval.samples=2", "progress_lines=true",
    ))
    trainer = train_lib.build_trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    return config


def test_the_adapter_learns_what_the_base_cannot_and_still_stops(evaluated_run, capsys):
    config = evaluated_run
    record = EvalRecord.from_json(json.loads(Path(config.layout.evaluation).read_text()))
    assert record is not None and record.step == STEPS and record.examples == 12 and len(record.samples) == 2
    assert record.base.score == 0.0, "a random base never answers in the trained form"
    assert record.adapter.score > 0.5 and record.adapter.stop_rate > 0.5, record
    assert record.base.mean_length > record.adapter.mean_length
    answers = [json.loads(line) for line in Path(config.layout.evaluation_samples).read_text().splitlines()]
    assert len(answers) == 12 and answers[0]["reference"] == arithmetic_rows(12, seed=1)[0]["answer"]


def test_export_is_refused_when_the_gate_says_no_and_writes_nothing(evaluated_run, tmp_path, capsys):
    layout = evaluated_run.layout
    gate = ["--require-improvement", "--evaluation", layout.evaluation]
    export.main(["--checkpoint", layout.checkpoints, "--out", str(tmp_path / "passed"), *gate])
    assert (tmp_path / "passed" / "adapter_config.json").is_file()

    record = EvalRecord.from_json(json.loads(Path(layout.evaluation).read_text()))
    unimproved = tmp_path / "evaluation.json"
    unimproved.write_text(json.dumps(replace(record, adapter=record.base).to_json()))
    with pytest.raises(SystemExit) as exited:
        export.main(["--checkpoint", layout.checkpoints, "--out", str(tmp_path / "refused"),
                     "--require-improvement", "--evaluation", str(unimproved)])
    assert exited.value.code == exit_codes.NO_IMPROVEMENT
    assert f"the adapter of step {STEPS} is not exported: it does not score above the base model" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    with pytest.raises(SystemExit) as exited:
        export.main(["--checkpoint", layout.checkpoints, "--out", str(tmp_path / "refused"),
                     "--minimum-score", "0.5", "--evaluation", str(tmp_path / "missing.json")])
    assert exited.value.code == exit_codes.CONFIG and "missing or unreadable" in capsys.readouterr().err
