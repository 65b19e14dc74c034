"""Shared fixtures: the real catalogue models (pulled into the cache on first use)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _catalogue_model(alias: str, env: str) -> Path:
    override = os.environ.get(env)
    if override:
        return Path(override)
    from stdengine.store import resolve_model

    return resolve_model(alias)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (catalogue alias smollm2-135m-instruct); INFER_TEST_SMOLLM2 overrides."""
    return _catalogue_model("smollm2-135m-instruct", "INFER_TEST_SMOLLM2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270M Q4_K_M (catalogue alias gemma-3-270m); INFER_TEST_GEMMA3 overrides."""
    return _catalogue_model("gemma-3-270m", "INFER_TEST_GEMMA3")
