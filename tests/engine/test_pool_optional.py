"""The pool is optional: the default install never imports Ray, and says what to install when asked for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import free_port
from voxgate.config import ConfigError, PoolSettings, Settings, settings_from
from voxgate.engine.runtime.client import EngineConfig
from voxgate.engine.errors import EngineUnavailable
from voxgate.engine.cluster.remote import RemoteEngineClient


def test_the_gateway_and_the_remote_client_do_not_import_ray():
    code = ("import sys, voxgate.cli, voxgate.signaling.server, voxgate.engine.cluster.remote, voxgate.engine.cluster.pool; "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_engine_serve_without_ray_names_the_extra():
    code = "import sys; sys.modules['ray'] = None; from voxgate.cli import main; sys.exit(main(['engine', 'serve', '--engine', 'tone']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert 'pip install ".[scale]"' in proc.stderr


def test_engine_url_settings():
    settings = settings_from(None, {"VOXGATE_ENGINE_URL": "http://pool:8000/"})
    assert settings.engine_url == "http://pool:8000/"
    settings.check()
    for bad in ("pool:8000", "ftp://pool/", "http://"):
        with pytest.raises(ConfigError, match="engine-url"):
            Settings(engine_url=bad).check()
    pool = settings_from(None, {"VOXGATE_POOL_NUM_GPUS": "0.25", "VOXGATE_POOL_MAX_REPLICAS": "4"}, kind=PoolSettings)
    assert (pool.num_gpus, pool.max_replicas) == (0.25, 4)
    pool.check()
    with pytest.raises(ConfigError):
        PoolSettings(min_replicas=3, max_replicas=2).check()


async def test_an_unreachable_pool_is_a_clear_error():
    client = RemoteEngineClient(f"http://127.0.0.1:{free_port()}/", EngineConfig(start_timeout=0.5))
    with pytest.raises(EngineUnavailable, match="voxgate engine serve"):
        await client.start()


@pytest.mark.parametrize("piece", [["pause", 10_000_000], ["pause", -1], ["pause", True], ["speech", "a", float("nan")],
                                   ["speech", "a", 1e9], ["speech", "a", True]])
def test_the_pool_refuses_tag_pieces_out_of_range(piece):
    from voxgate.engine.cluster.pool_protocol import PoolProtocolError, _check_unit

    with pytest.raises(PoolProtocolError):
        _check_unit([0, [piece]])
    assert _check_unit([0, [["speech", "a", 1.5], ["pause", 300]]])[0] == 0


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 0.5])
def test_a_directory_ttl_that_is_not_a_finite_second_or_more_is_refused(ttl):
    with pytest.raises(ConfigError, match="directory-ttl-s"):
        Settings(redis_url="redis://127.0.0.1:6379/0", advertise_url="http://127.0.0.1:8080", directory_ttl_s=ttl).check()
