"""`python -m lorajob_operator`: run the LoRAJob operator (kopf hosting it; replicas elect a leader through a Lease).

Settings come from LORAJOB_* environment variables (see settings.py); the kubeconfig from the
in-cluster service account or KUBECONFIG.
"""

from __future__ import annotations

import argparse
import logging
import sys

import kopf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorajob_operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    parser.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL (empty to disable); fails when the resync loop has stopped",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import lorajob_operator.handlers  # noqa: F401  (registers the handlers)

    namespaces = args.namespace or None
    kopf.run(
        standalone=True,  # no kopf peering (peers freeze each other: kopf#734); leader.py elects the leader
        clusterwide=namespaces is None,
        namespaces=namespaces or (),
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(namespaces=namespaces),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
