"""Shared test setup: no policy override leaks in from the environment."""

import pytest

import mpjax


@pytest.fixture(autouse=True)
def _no_policy_override(monkeypatch):
  monkeypatch.delenv(mpjax.POLICY_ENV_VAR, raising=False)
