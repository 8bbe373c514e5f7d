"""Did the fine-tune help? The base model and the trained adapter answer the same evaluation prompts (greedy
generation, generate.py), a scorer compares each answer with the reference, and both models' stop rates show
whether the fine-tuned model still ends its turn.

The train step runs it after its last step (`generation_eval.enabled`), on the devices it holds, with the model it
has loaded: the base is the same graph with the adapters as they start (B = 0, DoRA's magnitudes = the weights'
norms), which computes exactly the base model (under QLoRA: the quantised base the adapter was trained on).
The record goes to <run>/evaluation.json (the export step's gate reads it), every answer to
<run>/evaluation-samples.jsonl, and one LORAJOB_EVAL line to stdout (the operator's status.evaluation).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace

import jax

from lorajob_trainer import data as data_lib
from lorajob_trainer import storage
from lorajob_trainer.contract.config import GenerationEvalConfig
from lorajob_trainer.contract.records import EVAL_SAMPLE_CHARACTERS, EvalRecord, EvalSample, ModelScore, RunLayout
from lorajob_trainer.run import Run

log = logging.getLogger("lorajob_trainer.evaluate")

GSM8K_PATTERN = r"####\s*(-?[\d,]*\.?\d+)"
"""GSM8K's reference answers end with `#### <number>`."""
_PUNCTUATION_AT_ENDS = " \t\n.,;:!?\"'`"


def normalise(text: str) -> str:
    """Lower case, runs of whitespace as one space, punctuation and quotes at either end dropped."""
    return " ".join(text.lower().split()).strip(_PUNCTUATION_AT_ENDS)


def _number(text: str) -> str:
    """A number as written (thousands separators and a trailing .0 dropped), else the normalised text."""
    plain = text.replace(",", "").strip()
    try:
        value = float(plain)
    except ValueError:
        return normalise(text)
    return str(int(value)) if value.is_integer() else repr(value)


def extract(pattern: str, text: str) -> str | None:
    """The first match of `pattern` in `text`: its first group, else the whole match; None without a match."""
    found = re.search(pattern, text)
    if found is None:
        return None
    return found.group(1) if found.re.groups else found.group(0)


Scorer = Callable[[str, str], bool]
"""(answer, reference) -> whether the answer counts as right."""


def scorer(name: str, pattern: str = "") -> Scorer:
    """The scorer of generation_eval.scorer (contract.EVAL_SCORERS)."""
    if name == "exact_match":
        return lambda answer, reference: normalise(answer) == normalise(reference)
    if name == "contains":
        return lambda answer, reference: normalise(reference) in normalise(answer)
    if name in ("regex", "gsm8k"):
        regex = GSM8K_PATTERN if name == "gsm8k" else pattern

        def same_extracted(answer: str, reference: str) -> bool:
            mine, theirs = extract(regex, answer), extract(regex, reference)
            if mine is None or theirs is None:
                return False
            return _number(mine) == _number(theirs) if name == "gsm8k" else normalise(mine) == normalise(theirs)

        return same_extracted
    raise ValueError(f"unknown scorer {name!r}")


def stop_token_ids(tokenizer) -> list[int]:
    """EOS and the chat template's end-of-turn tokens: the special tokens the template writes after an assistant
    message (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...)."""
    special = set(tokenizer.all_special_ids)
    marker = "lorajob-answer"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    after = text[text.rindex(marker) + len(marker):]
    encode = data_lib.text_encoder(tokenizer)
    ids = {token for token in encode(after) if token in special}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def prompt_and_reference(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], str]:
    """The conversation up to its last assistant message, and that message (the reference answer)."""
    last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
    return messages[:last], messages[last]["content"]


def prompt_tokens(tokenizer, conversation: list[dict[str, str]], longest: int) -> list[int]:
    """The chat template's rendering of `conversation` with the generation prompt, its last `longest` tokens."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return data_lib.text_encoder(tokenizer)(text)[-longest:]


def answer_text(tokenizer, tokens: Sequence[int], stop_ids: Sequence[int]) -> str:
    stops = set(stop_ids)
    kept = list(tokens)
    if kept and kept[-1] in stops:
        kept = kept[:-1]
    return tokenizer.decode(kept, skip_special_tokens=True).strip()


def model_score(right: Sequence[bool], stopped: Sequence[bool], lengths: Sequence[int]) -> ModelScore:
    count = max(len(right), 1)
    return ModelScore(score=sum(right) / count, stop_rate=sum(stopped) / count, mean_length=sum(lengths) / count)


def _cut(text: str) -> str:
    return text if len(text) <= EVAL_SAMPLE_CHARACTERS else text[: EVAL_SAMPLE_CHARACTERS - 1] + "…"


def evaluate(run: Run, tokenizer, settings: GenerationEvalConfig, examples: Sequence[list[dict[str, str]]],
             adapters: Mapping[str, dict[str, jax.Array]], step: int, write_to: RunLayout | None,
             preference_accuracy: Mapping[str, float] | None = None) -> EvalRecord:
    """Generate with `run`'s model under each of the `adapters` ("base": as they start, "adapter": trained to
    `step`) for the `examples` (conversations, each ending with its reference answer) and score the answers;
    write the record under `write_to` (None: another process writes it) and print its line. A preference method
    passes each model's `preference_accuracy` (ModelScore.preference_accuracy), which the record carries."""
    started = time.time()
    conversations = [prompt_and_reference(messages) for messages in examples]
    longest_prompt = max(run.batch["inputs"].shape[2] - settings.max_new_tokens, 1)
    prompts = [prompt_tokens(tokenizer, conversation, longest_prompt) for conversation, _ in conversations]
    stop_ids = stop_token_ids(tokenizer)
    generator = run.generator(settings.max_new_tokens, stop_ids)
    rows = generator.batch_rows(settings.batch_size or run.batch["inputs"].shape[1])
    judge = scorer(settings.scorer, settings.pattern)
    answers, scores = {}, {}
    for name in ("base", "adapter"):
        generations = generator.generate(adapters[name], run.base, prompts, rows)
        answers[name] = [answer_text(tokenizer, g.tokens, stop_ids) for g in generations]
        right = [judge(answer, reference) for answer, (_, reference) in zip(answers[name], conversations)]
        scores[name] = replace(
            model_score(right, [g.stopped for g in generations], [len(g.tokens) for g in generations]),
            preference_accuracy=(preference_accuracy or {}).get(name),
        )
    prompt_texts = [conversation[-1]["content"] if conversation else "" for conversation, _ in conversations]
    samples = [
        EvalSample(prompt, reference, base, adapter)
        for prompt, (_, reference), base, adapter in zip(prompt_texts, conversations, answers["base"], answers["adapter"])
    ]
    record = EvalRecord(
        scorer=settings.scorer, examples=len(examples), step=step, max_new_tokens=settings.max_new_tokens,
        seconds=round(time.time() - started, 3), base=scores["base"], adapter=scores["adapter"],
        samples=tuple(EvalSample(*map(_cut, (s.prompt, s.reference, s.base, s.adapter))) for s in samples[: settings.samples]),
    )
    if write_to is not None:
        _write(write_to, record, samples)
        print(record.line(), flush=True)
    log.info("evaluation of step %d (%s, %d examples, %.1f s): base %.3f, adapter %.3f; stop rate base %.2f, adapter %.2f%s",
             step, record.scorer, record.examples, record.seconds, record.base.score, record.adapter.score,
             record.base.stop_rate, record.adapter.stop_rate,
             "" if preference_accuracy is None else "; preference accuracy base {base:.3f}, adapter {adapter:.3f}".format(
                 **preference_accuracy))
    return record


def _write(layout: RunLayout, record: EvalRecord, samples: list[EvalSample]) -> None:
    storage.write_text(layout.evaluation, json.dumps(record.to_json(), indent=1) + "\n")
    storage.write_text(layout.evaluation_samples, "".join(json.dumps(asdict(sample)) + "\n" for sample in samples))


def read_record(location: str) -> EvalRecord | None:
    """The record at `location` (a path or gs:// URI); None when there is none or it is unreadable."""
    text = storage.read_text(location)
    try:
        return None if text is None else EvalRecord.from_json(json.loads(text))
    except json.JSONDecodeError:
        return None
