"""The plugins' tests share one gateway with the embedded voice, and write each
plugin's first-audio time to artifacts/integrations-first-audio.json."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import ARTIFACTS


@pytest.fixture(scope="session")
def first_audio_report():
    figures: dict[str, float] = {}
    yield figures
    if figures:
        os.makedirs(ARTIFACTS, exist_ok=True)
        with open(os.path.join(ARTIFACTS, "integrations-first-audio.json"), "w") as f:
            json.dump(figures, f, indent=2)
