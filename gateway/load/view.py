"""What the gateway's parts read of the Gateway that makes them (gateway/gateway.py): its settings,
metrics, session registry and engine. Admission (`AdmissionHost`), a backend's link (`LinkHost`) and a
relay link (`RelayHost`) each extend this view with what only it uses, so none imports gateway.py, which
imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ...config import Settings
    from ...engine.runtime.client import EngineClient
    from .metrics import GatewayMetrics
    from ..sessions.registry import SessionRegistry


class GatewayView(Protocol):
    """The gateway as each of its parts sees it (read-only)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def registry(self) -> SessionRegistry: ...

    @property
    def engine(self) -> EngineClient: ...
