"""Static checks of deploy/k8s/rayservice.yaml, the engine pool on KubeRay.

No cluster runs here, so the RayService is read the way KubeRay and Serve
would: its structure against a vendored, strict schema of the fields it uses
(deploy/schemas/rayservice.json, with pod templates from kubernetes.json), its
serveConfigV2 (a YAML string) against Serve's config fields, and then what
matters for Voxgate: the import path and args name the real app builder and
PoolConfig fields, fractional GPUs land on a worker group that has GPUs, and the
ingress port is Serve's. Each check is also run on a broken copy.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
import re
import tomllib

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

from voxgate.engine.cluster.pool import DEPLOYMENT_NAME, DIRECT_INGRESS_ENV, DRAIN_ENV, DRAIN_S, PoolConfig
from voxgate.engine.registry import ENGINES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_PORT = 8000


def read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def schemas() -> tuple[dict, Registry]:
    rayservice = json.loads(read("deploy", "schemas", "rayservice.json"))
    k8s = json.loads(read("deploy", "schemas", "kubernetes.json"))
    registry = Registry().with_resources([(s["$id"], Resource.from_contents(s)) for s in (rayservice, k8s)])
    return rayservice, registry


def rayservice() -> dict:
    return yaml.safe_load(read("deploy", "k8s", "rayservice.yaml"))


def _errors(schema: dict, registry: Registry, doc) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _quantity(value) -> float:
    m = re.fullmatch(r"([0-9.]+)(m?)", str(value))
    return float(m.group(1)) / (1000 if m.group(2) else 1) if m else 0.0


def rayservice_problems(doc: dict) -> list[str]:
    schema, registry = schemas()
    problems = _errors(schema, registry, doc)
    if problems:
        return problems
    try:
        serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    except yaml.YAMLError as exc:
        return [f"serveConfigV2 is not YAML: {exc}"]
    serve_schema = {"$ref": "rayservice.json#/$defs/serveConfig"}
    problems = [f"serveConfigV2: {e}" for e in _errors(serve_schema, registry, serve_config)]
    if problems:
        return problems
    cluster = doc["spec"]["rayClusterConfig"]
    workers = cluster.get("workerGroupSpecs", [])
    (app,) = serve_config["applications"]
    module, _, attr = app["import_path"].partition(":")
    try:
        builder = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return [f"import_path {app['import_path']} names nothing importable"]
    if not callable(builder):
        problems.append(f"import_path {app['import_path']} is not an app builder")
    if app.get("route_prefix", "/") != "/":
        problems.append("route_prefix must be / : gateways' --engine-url names the ingress root")
    args = app.get("args", {})
    unknown = set(args) - {f.name for f in dataclasses.fields(PoolConfig)}
    if unknown:
        problems.append(f"args {sorted(unknown)} are not PoolConfig fields")
    if args.get("engine", "piper") not in ENGINES:
        problems.append(f"engine {args.get('engine')!r} is not one of {ENGINES}")
    deployments = {d["name"]: d for d in app.get("deployments", [])}
    if set(deployments) != {DEPLOYMENT_NAME}:
        problems.append(f"deployments must be exactly {DEPLOYMENT_NAME} (the name engine/cluster/pool.py gives it)")
        return problems
    dep = deployments[DEPLOYMENT_NAME]
    scaling = dep.get("autoscaling_config", {})
    if scaling and not 1 <= scaling["min_replicas"] <= scaling["max_replicas"]:
        problems.append("autoscaling needs 1 <= min_replicas <= max_replicas (0 would cut every call's first audio)")
    if scaling and scaling["target_ongoing_requests"] > dep.get("max_ongoing_requests", 5):
        problems.append("target_ongoing_requests above max_ongoing_requests never triggers a scale-up")
    actor = dep.get("ray_actor_options", {})
    gpus = actor.get("num_gpus", 0)
    if gpus > 1:
        problems.append("num_gpus above 1 per replica: a replica hosts one engine on one device")
    gpu_groups = [g for g in workers if any(
        _quantity(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) > 0
        for c in g["template"]["spec"]["containers"])]
    if gpus and not gpu_groups:
        problems.append("replicas ask for num_gpus but no worker group has nvidia.com/gpu")
    if gpus and args.get("device", "auto") == "cpu":
        problems.append("replicas reserve a GPU but the engine runs on device cpu")
    cpus = actor.get("num_cpus", 1)
    if not any(_quantity(c.get("resources", {}).get("limits", {}).get("cpu", 0)) >= cpus
               for g in workers for c in g["template"]["spec"]["containers"]):
        problems.append(f"no worker container has the {cpus} CPUs one replica reserves")
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    if SERVE_PORT not in [p["containerPort"] for p in head.get("ports", [])]:
        problems.append(f"the head container must expose Serve's HTTP port {SERVE_PORT} (the -serve-svc targets it)")
    for group in [cluster["headGroupSpec"], *workers]:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            # Every Ray node's Serve must agree, or some replicas listen themselves and others do not.
            if env.get(DIRECT_INGRESS_ENV) != "1":
                problems.append(f"{container['name']}: {DIRECT_INGRESS_ENV}=1 lets gateways skip the proxy's hop")
            if float(env.get(DRAIN_ENV) or 30) < DRAIN_S:
                problems.append(f"{container['name']}: {DRAIN_ENV} under {DRAIN_S} s cuts streams gateways still send")
        security = group["template"]["spec"].get("securityContext", {})
        if not security.get("runAsNonRoot") or security.get("runAsUser", 0) == 0:
            problems.append("Ray pods must run as a non-root user")
    # The [scale] extra pins Ray both ways (engine/cluster/ray_internals.py reads Serve's internals): the cluster's Ray within it.
    pin = re.search(r'"ray\[serve\]>=([0-9.]+),<([0-9.]+)"', read("pyproject.toml"))
    assert pin, "the [scale] extra pins ray[serve] as >=X,<Y"
    version = tuple(map(int, cluster.get("rayVersion", "0.0.0").split(".")))
    if version < tuple(map(int, pin.group(1).split("."))):
        problems.append(f"rayVersion is older than the [scale] extra's ray[serve]>={pin.group(1)}")
    if version >= tuple(map(int, pin.group(2).split("."))):
        problems.append(f"rayVersion is past the [scale] extra's ray[serve]<{pin.group(2)}")
    return problems


def test_rayservice_is_valid_and_fits_the_pool():
    schema, _ = schemas()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert tomllib.loads(read("pyproject.toml"))["project"]["optional-dependencies"]["scale"]
    assert rayservice_problems(rayservice()) == []


def _app(doc) -> tuple[dict, dict]:
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    return config, config["applications"][0]


def _edit_serve(edit):
    def apply(doc):
        config, app = _app(doc)
        edit(app)
        doc["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    return apply


def _dep(app) -> dict:
    return app["deployments"][0]


def _gpu_limits(doc) -> dict:
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]


BROKEN = [
    ("wrong apiVersion", lambda d: d.__setitem__("apiVersion", "ray.io/v1alpha2")),
    ("field typo", lambda d: d["spec"].__setitem__("serveConfigV3", d["spec"].pop("serveConfigV2"))),
    ("bad pod template", lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"].__setitem__("dnsPolicy", "Cluster")),
    ("rayStartParams not strings", lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0)),
    ("serveConfigV2 not YAML", lambda d: d["spec"].__setitem__("serveConfigV2", "applications: [")),
    ("serve field typo", _edit_serve(lambda a: _dep(a).__setitem__("autoscale_config", _dep(a).pop("autoscaling_config")))),
    ("import path to nothing", _edit_serve(lambda a: a.__setitem__("import_path", "voxgate.engine.cluster.pool:app"))),
    ("unknown arg", _edit_serve(lambda a: a["args"].__setitem__("voices", "joe"))),
    ("unknown engine", _edit_serve(lambda a: a["args"].__setitem__("engine", "espeak"))),
    ("route prefix", _edit_serve(lambda a: a.__setitem__("route_prefix", "/tts"))),
    ("deployment renamed", _edit_serve(lambda a: _dep(a).__setitem__("name", "Pool"))),
    ("scale to zero", _edit_serve(lambda a: _dep(a)["autoscaling_config"].__setitem__("min_replicas", 0))),
    ("target over max ongoing", _edit_serve(lambda a: _dep(a)["autoscaling_config"].__setitem__("target_ongoing_requests", 100))),
    ("two GPUs per replica", _edit_serve(lambda a: _dep(a)["ray_actor_options"].__setitem__("num_gpus", 2))),
    ("GPU replicas on a cpu engine", _edit_serve(lambda a: a["args"].__setitem__("device", "cpu"))),
    ("no GPU workers", lambda d: _gpu_limits(d).pop("nvidia.com/gpu")),
    ("replica bigger than a worker", _edit_serve(lambda a: _dep(a)["ray_actor_options"].__setitem__("num_cpus", 16))),
    ("no serve port", lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"].pop(2)),
    ("root", lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["securityContext"].__setitem__("runAsUser", 0)),
    ("no direct ingress on workers", lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].pop("env")),
    ("short drain on the workers", lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"][1].__setitem__("value", "1")),
    ("old ray", lambda d: d["spec"]["rayClusterConfig"].__setitem__("rayVersion", "2.9.0")),
]


@pytest.mark.parametrize("what, breaking", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_rayservice_fails(what, breaking):
    doc = copy.deepcopy(rayservice())
    breaking(doc)
    assert rayservice_problems(doc), f"{what}: not caught"
