"""Logging set-up: plain lines, or one JSON object per line with the session id and
a record's structured `fields` (passed as `extra={"fields": {...}}`) when present."""

from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        session_id = getattr(record, "session_id", None)
        if session_id:
            entry["session_id"] = session_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update({k: v for k, v in fields.items() if k not in entry})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class PlainFormatter(logging.Formatter):
    """One record, one line: line breaks inside a message are escaped, so text a
    client chose can never forge a log line of its own."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        return line.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


def setup_logging(level: str = "INFO", json_lines: bool = False) -> None:
    handler = logging.StreamHandler()
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PlainFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aioice").setLevel(logging.WARNING)
    logging.getLogger("aiortc").setLevel(logging.WARNING)
