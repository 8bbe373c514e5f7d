"""Trainer test fixtures shared across modules.

* `gcs`: gs:// on local disk. etils.epath's real fsspec backend (what storage.py and Orbax's path
  handling use) and TensorStore's kvstore (what Orbax reads and writes arrays through) both map
  gs://<bucket>/<key> to <root>/<bucket>/<key>, so nothing uses the network.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.local import LocalFileSystem
from lorajob_trainer import loading
from orbax.checkpoint._src.path import gcs_utils


class BucketsOnDisk(LocalFileSystem):
    """gs://<bucket>/<key> is the file <root>/<bucket>/<key>."""

    root = ""

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("gs://"):
            path = os.path.join(cls.root, path.removeprefix("gs://"))
        return super()._strip_protocol(path)

    def glob(self, path, **kwargs):
        """Matches as "bucket/key", without the protocol, as gcsfs returns them."""
        return [os.path.relpath(match, self.root) for match in super().glob(path, **kwargs)]


@pytest.fixture
def gcs(tmp_path, monkeypatch) -> Iterator[Path]:
    """The local directory behind gs://."""
    root = tmp_path / "gcs"
    root.mkdir()
    monkeypatch.setattr(BucketsOnDisk, "root", str(root))
    filesystem = BucketsOnDisk(skip_instance_cache=True)
    monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: filesystem)
    monkeypatch.setattr(
        gcs_utils,
        "get_kvstore_for_gcs",
        lambda path: {"driver": "file", "path": BucketsOnDisk._strip_protocol(path) + "/"},
    )
    yield root
    loading.local_config_directory.cache_clear()  # the same URI names another bucket in the next test
