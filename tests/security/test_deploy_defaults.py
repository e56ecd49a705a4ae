"""Finding 17: deployment defaults. A public bind needs keys, secrets come from env or files.

Before, `deploy/compose.yaml` bound 0.0.0.0 with an empty API key and no
`--require-token`, nothing warned, and API keys given as flags showed in `ps`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from sec_helpers import http_json, log_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VOXGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "voxgate.cli", "serve", "--engine", "tone", *args],
        capture_output=True, text=True, timeout=60, env={**clean, **(env or {})},
    )


def test_a_public_bind_without_keys_is_refused():
    done = serve("--host", "0.0.0.0", "--port", "1")
    assert done.returncode == 2
    assert "without an API key" in done.stderr and "--api-key-file" in done.stderr and "--allow-no-auth" in done.stderr


def test_a_secret_file_is_read_and_a_secret_flag_warns(server_factory, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\nfile-key\n")
    server = server_factory("tone", ["--api-key-file", str(key_file), "--api-key", "flag-key"])
    import asyncio

    async def check() -> None:
        for key, expected in (("file-key", 201), ("flag-key", 201), ("nope", 401)):
            status, _, _ = await http_json("POST", server.url + "/v1/sessions", headers={"X-API-Key": key})
            assert status == expected, key

    asyncio.run(check())
    assert "--api-key given on the command line" in log_text(server)


def test_an_unreadable_secret_file_says_so(tmp_path):
    done = serve("--api-key-file", str(tmp_path / "missing"))
    assert done.returncode != 0 and "--api-key-file" in done.stderr


def test_compose_files_need_a_key_and_tokens():
    for name in ("compose.yaml", "compose.bridge.yaml"):
        with open(os.path.join(ROOT, "deploy", name)) as f:
            env = yaml.safe_load(f)["services"]["voxgate"]["environment"]
        assert env["VOXGATE_API_KEY"].startswith("${VOXGATE_API_KEY:?"), name
        assert str(env["VOXGATE_REQUIRE_TOKEN"]).lower() == "true", name
