"""Fine-tune through the OpenAI fine-tuning API: the same script runs against a hosted service or a cluster's
`lorajob api`; only the environment says which.

    export OPENAI_BASE_URL=http://localhost:8080/v1                       # the chart's Service, port-forwarded
    export OPENAI_API_KEY=$(kubectl create token trainer -n team-a)       # a Kubernetes token
    export OPENAI_PROJECT_ID=team-a                                        # the namespace
    python examples/fine_tuning_api.py --model qwen3-4b train.jsonl --validation valid.jsonl --suffix support

Uploads the files, creates the job, prints its events as they come until it ends, then the fine-tuned model's name
and the job's checkpoints. Exit code 0 when the job succeeded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from openai import OpenAI

ENDED = ("succeeded", "failed", "cancelled")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("training_file", type=Path, help="JSONL: chat messages, prompt/completion or preference lines")
    parser.add_argument("--validation", type=Path, help="JSONL of the same layout, evaluated as training goes")
    parser.add_argument("--model", required=True, help="a base model the server offers (GET /v1/models)")
    parser.add_argument("--suffix", help="part of the fine-tuned model's name")
    parser.add_argument("--epochs", type=int, help="n_epochs (the server's choice when absent)")
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between looks at the job")
    args = parser.parse_args()

    client = OpenAI()  # base URL, API key and project from the environment
    training = client.files.create(file=args.training_file.open("rb"), purpose="fine-tune")
    validation = client.files.create(file=args.validation.open("rb"), purpose="fine-tune") if args.validation else None
    hyperparameters = {"n_epochs": args.epochs} if args.epochs else {}
    job = client.fine_tuning.jobs.create(
        model=args.model, training_file=training.id, validation_file=validation.id if validation else None,
        suffix=args.suffix, method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
    )
    print(f"job {job.id} created ({job.status})", flush=True)
    printed: set[str] = set()
    while True:
        job = client.fine_tuning.jobs.retrieve(job.id)
        for event in reversed(client.fine_tuning.jobs.list_events(job.id, limit=100).data):
            if event.id not in printed:
                printed.add(event.id)
                print(f"  {event.level:<5} {event.message}", flush=True)
        if job.status in ENDED:
            break
        time.sleep(args.poll)
    print(f"job {job.id} {job.status}")
    if job.status != "succeeded":
        print(f"error: {job.error}")
        return 1
    print(f"fine-tuned model: {job.fine_tuned_model}")
    for checkpoint in client.fine_tuning.jobs.checkpoints.list(job.id):
        print(f"  checkpoint at step {checkpoint.step_number}: train loss {checkpoint.metrics.train_loss}, "
              f"validation loss {checkpoint.metrics.valid_loss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
