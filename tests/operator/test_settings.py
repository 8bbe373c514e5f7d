"""Operator settings from LORAJOB_* environment variables."""

from __future__ import annotations

import pytest

from lorajob_operator.settings import OperatorSettings, Resources


def test_defaults_without_environment():
    assert OperatorSettings.from_env({}) == OperatorSettings()


def test_nested_overrides_are_parsed_by_type():
    settings = OperatorSettings.from_env({
        "LORAJOB_RENDER_IMAGES_TRAINER": "registry/trainer:1",
        "LORAJOB_RENDER_RESOURCES_CONVERT_CPU": "2",
        "LORAJOB_RENDER_CPU_NODE_POOL": "cpu-big",
        "LORAJOB_RECONCILE_RESYNC_SECONDS": "1.5",
        "LORAJOB_WATCH_SERVER_TIMEOUT_SECONDS": "30",
        "UNRELATED": "x",
    })
    assert settings.render.images.trainer == "registry/trainer:1"
    assert settings.render.resources.convert == Resources("2", "32Gi")
    assert settings.render.cpu_node_pool == "cpu-big"
    assert settings.reconcile.resync_seconds == 1.5
    assert settings.watch.server_timeout_seconds == 30


def test_a_misspelt_setting_is_an_error_not_a_silent_default():
    with pytest.raises(ValueError, match="LORAJOB_RECONCILE_RESYNC_SECOND"):
        OperatorSettings.from_env({"LORAJOB_RECONCILE_RESYNC_SECOND": "1"})
