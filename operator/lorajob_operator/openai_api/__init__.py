"""The OpenAI fine-tuning API over LoRAJobs: `lorajob api` (server.py), its configuration (config.py), uploaded
files (files.py) and the mapping between the API's jobs and LoRAJobs (jobs.py)."""

from __future__ import annotations

from pathlib import Path

from lorajob_operator import api

CALLER_RULES = [{"apiGroups": [api.GROUP], "resources": [api.PLURAL], "verbs": ["get", "list", "create", "patch", "delete"]}]
"""The RBAC rules a caller of the API needs in its namespace (the built-in `edit` role holds them): get to read files
and jobs, list to list jobs, create to upload and create, patch to cancel, pause and resume, delete to delete a file."""


def add_command(commands) -> None:
    serve = commands.add_parser("api", help="serve the OpenAI fine-tuning API over LoRAJobs (with the kubeconfig's "
                                "or the in-cluster service account's identity)")
    serve.add_argument("--config", type=Path, required=True, help="the server's YAML (openai_api.config.ServerConfig)")
    serve.add_argument("--listen", default="0.0.0.0:8080", help="host:port to listen on (default 0.0.0.0:8080)")
    serve.set_defaults(run=_serve)


def _serve(args) -> int:
    from lorajob_operator.openai_api import server

    return server.run(args.config, args.listen)
