"""How the `lorajob` command fails: one line on stderr that says what is wrong and what to do, never a traceback.

`main` runs each subcommand under one handler, which prints `explain(error)`. Exit codes: 2 for wrong
arguments (`OneLineParser`), 1 for any other failure, except where a subcommand gives its failures a code of
its own (`lorajob plan`: 1 says a LoRAJob does not fit, so a plan that cannot be made exits 2). A failure that
is none of the known kinds is a bug: its line says so, and `LORAJOB_TRACEBACK=1` shows the traceback.
"""

from __future__ import annotations

import argparse
import errno
import sys
from typing import NoReturn

import yaml

FAILED = 1
USAGE = 2
"""argparse's code for wrong arguments."""
INTERRUPTED = 130
"""What a shell reports for a command stopped by Ctrl-C (128 + SIGINT), as `lorajob logs -f` is."""
TRACEBACK_ENV = "LORAJOB_TRACEBACK"
LINE_LIMIT = 400
"""Characters of a foreign message kept (a compiler's can run to pages)."""

PATH_HINTS = {errno.ENOENT: "check the path", errno.EISDIR: "give the YAML files in it", errno.EACCES: "check its permissions"}


class CliError(Exception):
    """A failure the user can act on; the message (one line) says what is wrong and what to do."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line that points at the subcommand's --help (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def explain(error: Exception) -> str:
    """The line that says what went wrong and what to do; for an error of no known kind, that it is a bug."""
    if isinstance(error, CliError):
        return str(error)
    if isinstance(error, OSError) and error.filename is not None:
        hint = PATH_HINTS.get(error.errno)
        return f"{error.filename}: {error.strerror}" + (f" ({hint})" if hint else "")
    if isinstance(error, yaml.YAMLError):
        return _yaml_problem(error)
    if isinstance(error, ModuleNotFoundError) and error.name:
        return f"needs the Python package {error.name}, which is not installed here (pip install {error.name})"
    cluster_problem = _cluster_problem(error)
    if cluster_problem is not None:
        return cluster_problem
    return (f"unexpected {type(error).__name__}: {_one_line(str(error))} (a bug in lorajob: run again with "
            f"{TRACEBACK_ENV}=1 to see where, and report it)")


def _one_line(text: str) -> str:
    words = " ".join(text.split())
    return words if len(words) <= LINE_LIMIT else words[:LINE_LIMIT - 1] + "…"


def _yaml_problem(error: yaml.YAMLError) -> str:
    if isinstance(error, yaml.reader.ReaderError):  # bytes that are not text
        return (f"{error.name}, byte {error.position}: not YAML text ({error.reason}); check that it is the file "
                "you mean")
    mark, context_mark = getattr(error, "problem_mark", None), getattr(error, "context_mark", None)
    if mark is None:
        return f"not valid YAML: {_one_line(str(error))}"
    context = f" {error.context} from line {context_mark.line + 1}" if error.context and context_mark else ""
    return (f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {error.problem}{context}; "
            "fix it there")


def _cluster_problem(error: Exception) -> str | None:
    """The line for a kubeconfig that is missing or broken, an API server that cannot be reached or that refuses;
    None for any other error (the Kubernetes client is an optional package: without it loaded, none of its errors)."""
    if sys.modules.get("kubernetes") is None:
        return None
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError, MaxRetryError

    if isinstance(error, ConfigException):
        return (f"no usable kubeconfig ({_one_line(str(error))}): point KUBECONFIG at the cluster's kubeconfig, "
                "or pick one of its contexts with --context (kubectl config get-contexts lists them)")
    if isinstance(error, MaxRetryError):
        reason = str(error.reason).rpartition(": ")[2]
        return (f"cannot reach the Kubernetes API server {error.pool.host}:{error.pool.port} ({reason}): is the "
                "cluster up, and is the kubeconfig's current context the one you mean? (kubectl cluster-info)")
    if isinstance(error, HTTPError):
        return f"the Kubernetes API server did not answer ({_one_line(str(error))}): kubectl cluster-info checks the connection"
    if isinstance(error, ApiException):
        return (f"the Kubernetes API server refused: {error.status} {error.reason}: check what your kubeconfig's user "
                "may do (kubectl auth can-i --list)")
    return None
