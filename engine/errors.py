"""What can go wrong with a stream, as the gateway sees it, and what clients are told."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The worker could not be started or is restarting."""


class EngineCrashed(RuntimeError):
    """The worker died while this stream was open."""


class EngineStreamError(RuntimeError):
    """The engine refused this stream's text or options."""


ENGINE_ERROR_TEXT = "the engine could not synthesize this utterance's text"


def public_engine_error(exc: Exception) -> str:
    """What a client is told about an engine failure: generic text. The engine's own
    message (onnxruntime's, with its source paths) goes to the server log only."""
    if isinstance(exc, EngineStreamError):
        log.warning("engine refused a stream: %s", exc)
        return ENGINE_ERROR_TEXT
    return str(exc)  # crashes and restarts: our own words, no engine internals
