"""Static checks of deploy/compose.fleet.yaml: two gateways, Redis and an engine pool.

Read as compose would (variable interpolation, then the vendored compose-spec
schema), then the wiring a fleet needs: every gateway reaches the directory and
the pool by service name, advertises its own service name and port, shares the
keys, the token secret and Redis's password with the others, and publishes its
own UDP range; Redis requires that password and sits on an internal network
that only the gateways join.
Each check is also run on a broken copy.
"""

from __future__ import annotations

import copy
from urllib.parse import urlsplit

import pytest
import yaml

from test_deploy_files import (
    SETTINGS, _port_range, compose_schema, duration_s, env_dict, interpolate, read, schema_errors, setting_of,
)
from voxgate.config import Settings

FLEET_ENV = {"VOXGATE_API_KEY": "k" * 48, "TOKEN_SECRET": "s" * 64, "REDIS_PASSWORD": "p" * 64}
SHARED = ("VOXGATE_API_KEY", "VOXGATE_TOKEN_SECRET", "VOXGATE_REDIS_URL", "VOXGATE_REDIS_PASSWORD", "VOXGATE_ENGINE_URL")


def load(env=FLEET_ENV) -> dict:
    return interpolate(yaml.safe_load(read("deploy", "compose.fleet.yaml")), env)


def _command(service: dict) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else list(command)


def fleet_problems(doc: dict) -> list[str]:
    problems = schema_errors(compose_schema(), doc)
    if problems:
        return problems
    services = doc["services"]
    gateways = {n: s for n, s in services.items() if "VOXGATE_REDIS_URL" in env_dict(s.get("environment"))}
    if len(gateways) < 2:
        return ["a fleet needs at least two gateways with VOXGATE_REDIS_URL"]
    envs = {n: env_dict(s.get("environment")) for n, s in gateways.items()}
    advertised, udp = set(), []
    for name, service in gateways.items():
        env = envs[name]
        for var in env:
            if setting_of(var) is not None and setting_of(var) not in SETTINGS:
                problems.append(f"{name}: {var} is not a Voxgate setting")
        if service.get("build", {}).get("dockerfile") != "deploy/Dockerfile":
            problems.append(f"{name}: must be built from deploy/Dockerfile")
        redis = urlsplit(env["VOXGATE_REDIS_URL"])
        target = services.get(redis.hostname, {})
        if not target.get("image", "").startswith("redis:") or (redis.port or 6379) != 6379:
            problems.append(f"{name}: VOXGATE_REDIS_URL must name the redis service on 6379")
        url = urlsplit(env.get("VOXGATE_ADVERTISE_URL", ""))
        if url.hostname != name or url.port != int(env.get("VOXGATE_PORT", Settings().port)):
            problems.append(f"{name}: VOXGATE_ADVERTISE_URL must be http://{name}:<VOXGATE_PORT>, its own address")
        advertised.add(env.get("VOXGATE_ADVERTISE_URL"))
        engine = urlsplit(env.get("VOXGATE_ENGINE_URL", ""))
        pool = services.get(engine.hostname)
        command = _command(pool) if pool else []
        if command[:3] != ["voxgate", "engine", "serve"] or "--port" not in command or \
                int(command[command.index("--port") + 1]) != engine.port:
            problems.append(f"{name}: VOXGATE_ENGINE_URL must name the pool service's `voxgate engine serve --port`")
        elif "scale" not in str(pool.get("build", {}).get("args", {}).get("EXTRAS", "")):
            problems.append("the pool must be built with EXTRAS=scale (Ray Serve)")
        drain = float(env.get("VOXGATE_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
        if duration_s(service.get("stop_grace_period", "10s")) <= drain:
            problems.append(f"{name}: stop_grace_period must be longer than VOXGATE_DRAIN_TIMEOUT_S")
        test = service.get("healthcheck", {}).get("test", [])
        if "/healthz" not in " ".join(test if isinstance(test, list) else [test]):
            problems.append(f"{name}: the healthcheck must probe /healthz")
        sysctl = env_dict(service.get("sysctls")).get("net.ipv4.ip_local_port_range", "")
        pinned = tuple(int(x) for x in sysctl.split()) if sysctl else None
        ranges = [r for r in (_port_range(p) for p in service.get("ports", []) if isinstance(p, str)) if r]
        if pinned is None or pinned not in ranges:
            problems.append(f"{name}: publish the UDP range of net.ipv4.ip_local_port_range 1:1")
        else:
            udp.append(pinned)
    if len(advertised) != len(gateways):
        problems.append("each gateway must advertise its own URL")
    for var in SHARED:
        if len({envs[n].get(var) for n in gateways}) != 1 or not next(iter(envs.values())).get(var):
            problems.append(f"{var} must be set, and the same on every gateway")
    udp.sort()
    if any(a[1] >= b[0] for a, b in zip(udp, udp[1:])):
        problems.append("the gateways' published UDP ranges overlap")
    return problems + _directory_problems(doc, gateways, envs)


def _networks(service: dict) -> set[str]:
    networks = service.get("networks", ["default"])
    return set(networks if isinstance(networks, list) else networks.keys())


def _directory_problems(doc: dict, gateways: dict, envs: dict) -> list[str]:
    """Redis requires the gateways' password and is reachable from the gateways alone."""
    services = doc["services"]
    names = {urlsplit(env["VOXGATE_REDIS_URL"]).hostname for env in envs.values()}
    if len(names) != 1 or next(iter(names)) not in services:
        return []  # reported above
    redis = services[next(iter(names))]
    problems = []
    command = " ".join(_command(redis))
    password = next(iter(envs.values())).get("VOXGATE_REDIS_PASSWORD")
    # The container's shell expands $REDIS_PASSWORD (written $$REDIS_PASSWORD in the file).
    given = env_dict(redis.get("environment")).get("REDIS_PASSWORD") if "$REDIS_PASSWORD" in command else command
    if "--requirepass" not in command or not password or password not in (given or ""):
        problems.append("redis must require the password the gateways give (--requirepass, VOXGATE_REDIS_PASSWORD)")
    declared = doc.get("networks", {}) or {}
    for network in _networks(redis):
        if not (declared.get(network) or {}).get("internal"):
            problems.append(f"redis is on network {network}, which is not internal")
        others = [n for n, svc in services.items() if network in _networks(svc) and svc is not redis and n not in gateways]
        if others:
            problems.append(f"{', '.join(others)} share network {network} with redis: only the gateways may")
    return problems


def test_fleet_compose_is_valid_and_wired():
    assert fleet_problems(load()) == []


def test_fleet_compose_refuses_to_start_without_the_key_and_secret():
    with pytest.raises(KeyError, match="VOXGATE_API_KEY"):
        load({"TOKEN_SECRET": "x"})
    with pytest.raises(KeyError, match="TOKEN_SECRET"):
        load({"VOXGATE_API_KEY": "x", "REDIS_PASSWORD": "x"})
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        load({"VOXGATE_API_KEY": "x", "TOKEN_SECRET": "x"})


def _env(doc, service):
    return doc["services"][service]["environment"]


BROKEN = [
    ("unknown service key", lambda d: d["services"]["gateway-a"].__setitem__("network-mode", "host")),
    ("unknown VOXGATE variable", lambda d: _env(d, "gateway-a").__setitem__("VOXGATE_REDIS_URI", "redis://redis:6379/0")),
    ("advertises another gateway", lambda d: _env(d, "gateway-b").__setitem__("VOXGATE_ADVERTISE_URL", "http://gateway-a:8080")),
    ("advertises the published port", lambda d: _env(d, "gateway-a").__setitem__("VOXGATE_ADVERTISE_URL", "http://gateway-a:8081")),
    ("no advertise url", lambda d: _env(d, "gateway-a").pop("VOXGATE_ADVERTISE_URL")),
    ("redis url to no service", lambda d: _env(d, "gateway-a").__setitem__("VOXGATE_REDIS_URL", "redis://directory:6379/0")),
    ("token secrets differ", lambda d: _env(d, "gateway-b").__setitem__("VOXGATE_TOKEN_SECRET", "other")),
    ("api keys differ", lambda d: _env(d, "gateway-b").__setitem__("VOXGATE_API_KEY", "other")),
    ("engine url on a wrong port", lambda d: _env(d, "gateway-a").__setitem__("VOXGATE_ENGINE_URL", "http://pool:8001/")),
    ("pool runs the gateway", lambda d: d["services"]["pool"].__setitem__("command", ["voxgate", "serve"])),
    ("pool without Ray Serve", lambda d: d["services"]["pool"]["build"].pop("args")),
    ("overlapping UDP ranges", lambda d: (
        d["services"]["gateway-b"].__setitem__("ports", ["8082:8080/tcp", "40100-40299:40100-40299/udp"]),
        d["services"]["gateway-b"]["sysctls"].__setitem__("net.ipv4.ip_local_port_range", "40100 40299"))),
    ("range not published 1:1", lambda d: d["services"]["gateway-a"].__setitem__("ports", ["8081:8080/tcp", "41000-41199:40000-40199/udp"])),
    ("grace shorter than drain", lambda d: d["services"]["gateway-a"].__setitem__("stop_grace_period", "5s")),
    ("one gateway", lambda d: d["services"].pop("gateway-b")),
    ("redis without a password", lambda d: d["services"]["redis"].__setitem__("command", ["redis-server", "--save", ""])),
    ("redis password differs", lambda d: d["services"]["redis"]["environment"].__setitem__("REDIS_PASSWORD", "other")),
    ("a gateway without the password", lambda d: _env(d, "gateway-b").pop("VOXGATE_REDIS_PASSWORD")),
    ("redis on the default network", lambda d: d["services"]["redis"].pop("networks")),
    ("the pool reaches redis", lambda d: d["services"]["pool"].__setitem__("networks", ["default", "directory"])),
    ("directory network not internal", lambda d: d["networks"]["directory"].pop("internal")),
]


@pytest.mark.parametrize("what, breaking", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_fleet_compose_fails(what, breaking):
    doc = copy.deepcopy(load())
    breaking(doc)
    assert fleet_problems(doc), f"{what}: not caught"


def test_the_anchor_gives_both_gateways_the_same_hardening():
    doc = load()
    a, b = doc["services"]["gateway-a"], doc["services"]["gateway-b"]
    for key in ("read_only", "cap_drop", "security_opt", "healthcheck", "stop_grace_period"):
        assert a[key] == b[key] and a[key], key
