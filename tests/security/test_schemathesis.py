"""schemathesis fuzzes the live server against its own OpenAPI description.

Every operation gets generated requests, valid and invalid, with and without
the API key. Every response must be documented (status, content type, body
schema, headers) and none may be a server error.
"""

from __future__ import annotations

import os
import subprocess
import sys

SCALE = float(os.environ.get("VOXGATE_FUZZ_SCALE", "1"))


def test_schemathesis_finds_nothing(server_factory, artifacts_dir):
    # Short audio per TTS request keeps generated texts cheap; anonymous sessions
    # per address and per key are plenty for the examples.
    server = server_factory("tone", ["--api-key", "k", "--tts-max-audio-s", "2", "--max-sessions-per-address", "1000",
                                     "--max-sessions-per-key", "1000", "--max-sessions", "2000"])
    report = os.path.join(artifacts_dir, "schemathesis.json")
    # Through this interpreter, not an `st` script beside it: a venv over the system's packages has
    # schemathesis importable but no script of its own, and a plain install has both.
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance,response_headers_conformance",
        "--header", "X-API-Key: k",
        "--max-examples", str(int(40 * SCALE)),
        "--seed", "13",
        "--workers", "1",
        "--phases", "examples,coverage,fuzzing",
        "--request-timeout", "30",
        "--no-color",
        "--report", "json", "--report-json-path", report,
        "--generation-database", "none",
    ]
    # schemathesis keeps a cache in its working directory: run it among the artifacts.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=artifacts_dir)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
