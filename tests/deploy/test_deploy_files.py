"""Static checks of deploy/: Dockerfiles, compose files, Kubernetes manifests.

No container engine or cluster runs on the CI machines, so these files are
checked the way the tools would read them: the Dockerfiles by a small parser
(instructions, stages, continuations, JSON-form arguments), the compose files
after compose's variable interpolation against the compose-spec schema, the
manifests against strict Kubernetes schemas. The schemas are vendored in
deploy/schemas/ (no network at test time). On top of the schemas come the
checks that matter for Voxgate: what gets installed matches the README, the
process runs as a non-root user, probes and grace periods fit the drain, and
every VOXGATE_* variable is a real setting. Each check is also run on a broken
copy, so a check that cannot fail does not pass unnoticed.
"""

from __future__ import annotations

import copy
import json
import os
import posixpath
import re
import shlex
import tomllib
from urllib.parse import urlsplit
from dataclasses import dataclass, fields

import jsonschema
import pytest
import yaml

from voxgate.config import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
SETTINGS = {f.name for f in fields(Settings)}
SERVE_CMD = ["voxgate", "serve", "--host", "0.0.0.0"]
COMPOSE_ENV = {"PUBLIC_IP": "203.0.113.10", "TURN_SECRET": "0123456789abcdef", "VOXGATE_API_KEY": "k" * 48}


def read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def pyproject() -> dict:
    return tomllib.loads(read("pyproject.toml"))


# ---------------------------------------------------------------------------
# Dockerfile


@dataclass
class Instruction:
    cmd: str  # upper-case keyword
    args: str  # the rest, continuations joined
    stage: int  # index of the FROM it belongs to; -1 before the first FROM
    line: int

    def json_args(self) -> list[str] | None:
        """The exec (JSON array) form, or None for the shell form."""
        if not self.args.startswith("["):
            return None
        try:
            value = json.loads(self.args)
        except ValueError:
            return None
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def parse_dockerfile(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    stage = -1
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continuation are dropped by the builder
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, " ".join(rest.split()), stage, start))
        buf = ""
    if buf:
        raise ValueError(f"line {start}: the file ends inside a continuation")
    return out


def _substitute(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), value)


def base_images(instructions: list[Instruction]) -> list[str]:
    """Each stage's base image, with global ARG defaults substituted."""
    args = {}
    for ins in instructions:
        if ins.cmd == "ARG" and ins.stage == -1 and "=" in ins.args:
            name, _, default = ins.args.partition("=")
            args[name] = default.strip('"')
    return [_substitute(ins.args.split()[0], args) for ins in instructions if ins.cmd == "FROM"]


def shell_commands(run: str) -> list[list[str]]:
    """A RUN's shell text as simple commands: words split on &&, ||, ; and | outside quotes."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append(words)
            words = []
        else:
            words.append(token)
    return [c for c in commands + [words] if c]


def _pip_installs(run: str) -> list[list[str]]:
    """The non-option arguments of every `pip install` in a RUN."""
    out = []
    for words in shell_commands(run):
        for i in range(len(words) - 1):
            if words[i] in ("pip", "pip3") and words[i + 1] == "install":
                out.append([w for w in words[i + 2 :] if not w.startswith("-")])
                break
            if words[i] == "-m" and words[i + 1] == "pip" and words[i + 2 : i + 3] == ["install"]:
                out.append([w for w in words[i + 3 :] if not w.startswith("-")])
                break
    return out


def _uninstalls(run: str) -> list[str]:
    out = []
    for words in shell_commands(run):
        if "uninstall" in words:
            out += [w for w in words[words.index("uninstall") + 1 :] if not w.startswith("-")]
    return out


def dockerfile_problems(text: str, cuda: bool) -> list[str]:
    """What is wrong with a Voxgate Dockerfile; an empty list when nothing is."""
    problems: list[str] = []
    try:
        ins = parse_dockerfile(text)
    except ValueError as exc:
        return [str(exc)]
    bases = base_images(ins)
    if not bases:
        return ["no FROM"]
    last = len(bases) - 1
    final = [i for i in ins if i.stage == last]
    final_base = bases[-1]
    if cuda:
        if not (final_base.startswith("nvidia/cuda:") and "runtime" in final_base):
            problems.append(f"the CUDA image must run on an nvidia/cuda runtime image, not {final_base}")
    elif not re.match(r"python:3\.(1[1-9])", final_base):
        problems.append(f"the CPU image must run on python:3.11 or later, not {final_base}")

    users = [i.args.split(":")[0] for i in final if i.cmd == "USER"]
    if not users or users[-1] in ("root", "0"):
        problems.append("the final stage must switch to a non-root USER")
    elif not any(i.cmd == "RUN" and users[-1] in i.args and "useradd" in i.args for i in final):
        problems.append(f"USER {users[-1]} is never created with useradd in the final stage")
    else:
        last_user = max(i.line for i in final if i.cmd == "USER")
        if any(i.cmd == "RUN" and i.line > last_user for i in final):
            problems.append("RUN after USER: install steps must run before dropping privileges")

    if not any(i.cmd == "EXPOSE" and "8080" in i.args.split() for i in final):
        problems.append("EXPOSE 8080 is missing")
    health = [i for i in final if i.cmd == "HEALTHCHECK"]
    if not health or "/healthz" not in health[-1].args or " CMD " not in f" {health[-1].args} ":
        problems.append("HEALTHCHECK must probe /healthz")
    cmds = [i for i in final if i.cmd == "CMD"]
    if not cmds or cmds[-1].json_args() != SERVE_CMD:
        problems.append(f"CMD must be the exec form {json.dumps(SERVE_CMD)}")
    if any(i.cmd == "ENTRYPOINT" for i in final):
        problems.append("an ENTRYPOINT would wrap `voxgate serve`; signals must reach it directly")

    # What is installed: the README's `pip install .`, run where the project was copied.
    project = pyproject()
    package_dirs = set(project["tool"]["setuptools"]["package-dir"].values())
    needed = {"pyproject.toml", project["project"]["readme"], *package_dirs}
    gpu_extra = next(name for name, deps in project["project"]["optional-dependencies"].items()
                     if any(d.startswith("torch") for d in deps))
    # Both images carry the fleet extra (only the Redis client of --redis-url), so that
    # one image serves a standalone gateway and a fleet member.
    fleet_extra = "fleet"
    assert fleet_extra in project["project"]["optional-dependencies"]
    workdir, copied, installed_at = "/", set(), None
    build_args: dict[str, str] = {}  # ARG defaults, substituted in RUN (the default build)
    install_stage = None
    ort_removed = ort_gpu = False
    for i in ins:
        if i.cmd == "FROM":
            workdir = "/"
        elif i.cmd == "ARG" and "=" in i.args:
            name, _, default = i.args.partition("=")
            build_args[name] = default.strip('"')
        elif i.cmd == "WORKDIR":
            workdir = posixpath.join(workdir, i.args)
        elif i.cmd == "COPY" and not i.args.startswith("--from"):
            *sources, dest = i.args.split()
            dest = posixpath.normpath(posixpath.join(workdir, dest))
            for src in sources:
                # Several sources, or a destination ending in '/', keep their names under it.
                into = len(sources) > 1 or i.args.endswith("/")
                copied.add(posixpath.join(dest, posixpath.basename(src.rstrip("/"))) if into else dest)
        elif i.cmd == "RUN":
            for words in shell_commands(_substitute(i.args, build_args)):
                for args in _pip_installs(shlex.join(words)):
                    if installed_at is None and args and args[0].split("[")[0] == ".":
                        installed_at, install_stage = workdir, i.stage
                        extras = re.findall(r"\[([^\]]*)\]", args[0])
                        wanted_extras = {gpu_extra, fleet_extra} if cuda else {fleet_extra}
                        got = set(extras[0].split(",")) if extras else set()
                        if got != wanted_extras:
                            problems.append(f"`pip install .` with extras {sorted(got)}; expected {sorted(wanted_extras)}")
                    elif installed_at is not None and any(a.startswith("onnxruntime-gpu") for a in args):
                        ort_gpu = ort_removed
                    elif not cuda:
                        problems.append(f"the CPU image installs more than the README: pip install {' '.join(args)}")
                if installed_at is not None and "onnxruntime" in _uninstalls(shlex.join(words)):
                    ort_removed = True
    if installed_at is None:
        problems.append("no `pip install .` of the project (the README's set-up)")
    else:
        missing = {n for n in needed if posixpath.join(installed_at, n) not in copied}
        if missing:
            problems.append(f"`pip install .` runs in {installed_at} without {sorted(missing)} copied there")
        if install_stage != last and not any(
            i.cmd == "COPY" and i.args.startswith("--from") and i.stage == last for i in ins
        ):
            problems.append("the project is installed in a build stage that the final stage never copies from")
    if cuda and not ort_gpu:
        problems.append("the CUDA image must uninstall onnxruntime, then install onnxruntime-gpu, after the project")
    return problems


DOCKERFILES = [("Dockerfile", False), ("Dockerfile.cuda", True)]


@pytest.mark.parametrize("name, cuda", DOCKERFILES)
def test_dockerfiles_install_like_the_readme_and_run_voxgate_serve_as_non_root(name, cuda):
    assert "pip install . && voxgate serve" in read("README.md")  # the set-up these images follow
    assert dockerfile_problems(read("deploy", name), cuda) == []


@pytest.mark.parametrize("name, cuda", DOCKERFILES)
def test_dockerignore_keeps_what_the_install_needs(name, cuda):
    # BuildKit reads <Dockerfile>.dockerignore; everything is excluded, then re-included.
    lines = [l.strip() for l in read("deploy", name + ".dockerignore").splitlines() if l.strip() and not l.startswith("#")]
    assert lines[0] == "*"
    kept = {l[1:].rstrip("/") for l in lines if l.startswith("!")}
    project = pyproject()
    assert {"pyproject.toml", project["project"]["readme"], *project["tool"]["setuptools"]["package-dir"].values()} <= kept


BROKEN_DOCKERFILES = [
    ("runs as root", lambda t: t.replace("USER 10001:10001", "USER root")),
    ("no user switch", lambda t: t.replace("USER 10001:10001\n", "")),
    ("RUN after USER", lambda t: t.replace("WORKDIR /home/voxgate", "RUN pip list\nWORKDIR /home/voxgate")),
    ("no healthcheck", lambda t: re.sub(r"HEALTHCHECK .*?\n  CMD .*?\n", "", t, flags=re.S)),
    ("healthcheck on readyz", lambda t: t.replace("/healthz", "/readyz")),
    ("shell-form CMD", lambda t: t.replace('CMD ["voxgate", "serve", "--host", "0.0.0.0"]', "CMD voxgate serve --host 0.0.0.0")),
    ("loopback only", lambda t: t.replace('"0.0.0.0"]', '"127.0.0.1"]')),
    ("no expose", lambda t: t.replace("EXPOSE 8080", "EXPOSE 9090")),
    ("installs from PyPI, not the tree", lambda t: t.replace('RUN pip install ".[${EXTRAS}]"', "RUN pip install voxgate").replace('RUN pip install ".[gpu,fleet]"', "RUN pip install voxgate[gpu]")),
    ("no fleet extra", lambda t: t.replace("ARG EXTRAS=fleet", "ARG EXTRAS=gpu").replace('".[gpu,fleet]"', '".[gpu]"')),
    ("a package folder not copied", lambda t: t.replace("COPY engine ./engine\n", "")),
    ("copied elsewhere", lambda t: t.replace("COPY engine ./engine", "COPY engine /opt/engine")),
    ("installed elsewhere", lambda t: t.replace("COPY web ./web\n", "COPY web ./web\nWORKDIR /tmp\n")),
    ("unterminated continuation", lambda t: t.rstrip() + " \\\n"),
]


@pytest.mark.parametrize("name, cuda", DOCKERFILES)
@pytest.mark.parametrize("what, breaking", BROKEN_DOCKERFILES, ids=[b[0] for b in BROKEN_DOCKERFILES])
def test_broken_dockerfiles_fail_the_checks(name, cuda, what, breaking):
    text = read("deploy", name)
    broken = breaking(text)
    assert broken != text, f"the mutation {what!r} no longer applies to {name}"
    assert dockerfile_problems(broken, cuda), f"{what}: not caught"


def test_cuda_image_must_swap_onnxruntime_and_add_the_torch_extra():
    text = read("deploy", "Dockerfile.cuda")
    assert dockerfile_problems(text.replace(" && pip uninstall -y onnxruntime", ""), True)
    assert dockerfile_problems(text.replace('".[gpu,fleet]"', '".[fleet]"'), True)
    assert dockerfile_problems(text.replace("nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04", "ubuntu:24.04"), True)
    # and the CPU image must not carry the extra
    assert dockerfile_problems(read("deploy", "Dockerfile").replace("ARG EXTRAS=fleet", "ARG EXTRAS=fleet,gpu"), False)


def test_the_dockerfile_parser_reads_continuations_and_forms():
    ins = parse_dockerfile('ARG B=python:3.11\nFROM ${B} AS x\n# c\nRUN a \\\n  # inside\n  && b\nCMD ["x", "y"]\nCMD x y\n')
    assert [(i.cmd, i.stage) for i in ins] == [("ARG", -1), ("FROM", 0), ("RUN", 0), ("CMD", 0), ("CMD", 0)]
    assert ins[2].args == "a && b"
    assert ins[3].json_args() == ["x", "y"] and ins[4].json_args() is None
    assert base_images(ins) == ["python:3.11"]
    assert _pip_installs('pip install ".[gpu]" && pip uninstall -y x && python -m pip install -q y') == [[".[gpu]"], ["y"]]


# ---------------------------------------------------------------------------
# Compose


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error} and $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        present = name in env and (env[name] != "" or ":" not in op)
        if op.endswith("?") and not present:
            raise KeyError(f"{name}: {arg or 'required'}")
        if op.endswith("-") and not present:
            return arg
        return env.get(name, "")

    return re.sub(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}", sub, value)


def compose_schema() -> dict:
    return json.loads(read("deploy", "schemas", "compose-spec.json"))


def k8s_schema() -> dict:
    return json.loads(read("deploy", "schemas", "kubernetes.json"))


def schema_errors(schema: dict, doc) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def duration_s(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ms|us|ns|h|m|s)", text))


def env_dict(environment) -> dict[str, str]:
    if isinstance(environment, list):
        return dict(e.split("=", 1) if "=" in e else (e, "") for e in environment)
    return {k: "" if v is None else str(v) for k, v in (environment or {}).items()}


def setting_of(var: str) -> str | None:
    return var[len("VOXGATE_"):].lower() if var.startswith("VOXGATE_") else None


def _port_range(spec: str) -> tuple[int, int] | None:
    m = re.match(r"^(?:[\d.]+:)?(\d+)(?:-(\d+))?:(\d+)(?:-(\d+))?/udp$", spec)
    if not m:
        return None
    host = (int(m.group(1)), int(m.group(2) or m.group(1)))
    inside = (int(m.group(3)), int(m.group(4) or m.group(3)))
    return inside if host == inside else None


def compose_problems(doc: dict) -> list[str]:
    problems = schema_errors(compose_schema(), doc)
    if problems:
        return problems
    services = doc["services"]
    gateway = next((s for s in services.values() if s.get("build", {}).get("dockerfile", "").startswith("deploy/Dockerfile")), None)
    turn = next((s for s in services.values() if "coturn" in s.get("image", "")), None)
    if gateway is None or turn is None:
        return ["needs the gateway (built from deploy/Dockerfile*) and a coturn service"]
    if not os.path.exists(os.path.join(DEPLOY, "..", gateway["build"]["dockerfile"])):
        problems.append(f"{gateway['build']['dockerfile']} does not exist")
    env = env_dict(gateway.get("environment"))
    for var in env:
        if setting_of(var) is not None and setting_of(var) not in SETTINGS:
            problems.append(f"{var} is not a Voxgate setting")
    drain = float(env.get("VOXGATE_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
    if duration_s(gateway.get("stop_grace_period", "10s")) <= drain:
        problems.append("stop_grace_period must be longer than VOXGATE_DRAIN_TIMEOUT_S")
    test = gateway.get("healthcheck", {}).get("test", [])
    if "/healthz" not in " ".join(test if isinstance(test, list) else [test]):
        problems.append("the gateway's healthcheck must probe /healthz")
    # TURN: coturn's REST-auth secret and the gateway's are one and the same.
    args = turn.get("command", [])
    args = shlex.split(args) if isinstance(args, str) else args
    opts = dict(a.split("=", 1) if "=" in a else (a, "") for a in args)
    if "--use-auth-secret" not in opts:
        problems.append("coturn needs --use-auth-secret")
    if not env.get("VOXGATE_TURN_SECRET") or opts.get("--static-auth-secret") != env.get("VOXGATE_TURN_SECRET"):
        problems.append("coturn's --static-auth-secret must equal the gateway's VOXGATE_TURN_SECRET")
    if not any(u.startswith("turn:") for u in env.get("VOXGATE_ICE_SERVER", "").split(",")):
        problems.append("VOXGATE_ICE_SERVER must name the TURN server (turn:...)")
    # UDP media: host networking, or a published range that is the kernel's ephemeral range.
    for name, service in (("gateway", gateway), ("coturn", turn)):
        if service.get("network_mode") == "host":
            if service.get("ports") or service.get("sysctls"):
                problems.append(f"{name}: ports and sysctls do not apply with network_mode host")
            continue
        ranges = [r for r in (_port_range(p) for p in service.get("ports", []) if isinstance(p, str)) if r]
        if name == "gateway":
            sysctl = env_dict(service.get("sysctls")).get("net.ipv4.ip_local_port_range", "")
            pinned = tuple(int(x) for x in sysctl.split()) if sysctl else None
            if pinned not in ranges:
                problems.append("gateway: publish the UDP range of net.ipv4.ip_local_port_range 1:1, or use network_mode host")
        else:
            relay = (int(opts.get("--min-port", 49152)), int(opts.get("--max-port", 65535)))
            if relay not in ranges:
                problems.append("coturn: publish its relay range --min-port..--max-port 1:1, or use network_mode host")
    return problems


COMPOSE_FILES = ["compose.yaml", "compose.bridge.yaml"]


def load_compose(name: str, env=COMPOSE_ENV) -> dict:
    return interpolate(yaml.safe_load(read("deploy", name)), env)


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_files_are_valid_and_wire_turn_and_udp(name):
    jsonschema.Draft202012Validator.check_schema(compose_schema())
    assert compose_problems(load_compose(name)) == []


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_refuses_to_start_without_the_address_and_secret(name):
    with pytest.raises(KeyError, match="PUBLIC_IP"):
        load_compose(name, {"TURN_SECRET": "x"})
    with pytest.raises(KeyError, match="TURN_SECRET"):
        load_compose(name, {"PUBLIC_IP": "203.0.113.10"})


def _gateway(doc):
    return doc["services"]["voxgate"]


BROKEN_COMPOSE = [
    ("unknown service key", lambda d: _gateway(d).__setitem__("network-mode", "host")),
    ("unknown top-level key", lambda d: d.__setitem__("service", {})),
    ("grace period without unit", lambda d: _gateway(d).__setitem__("stop_grace_period", 30)),
    ("healthcheck typo", lambda d: _gateway(d)["healthcheck"].__setitem__("intervall", "5s")),
    ("ulimit typo", lambda d: _gateway(d).setdefault("ulimits", {}).__setitem__("nofile", {"soft": 1, "hrad": 2})),
    ("grace shorter than drain", lambda d: _gateway(d).__setitem__("stop_grace_period", "5s")),
    ("unknown VOXGATE variable", lambda d: _gateway(d)["environment"].__setitem__("VOXGATE_MAX_SESSION", "5")),
    ("secrets differ", lambda d: _gateway(d)["environment"].__setitem__("VOXGATE_TURN_SECRET", "other")),
    ("no REST auth", lambda d: d["services"]["coturn"]["command"].remove("--use-auth-secret")),
    ("no TURN url", lambda d: _gateway(d)["environment"].__setitem__("VOXGATE_ICE_SERVER", "stun:203.0.113.10:3478")),
]


@pytest.mark.parametrize("name", COMPOSE_FILES)
@pytest.mark.parametrize("what, breaking", BROKEN_COMPOSE, ids=[b[0] for b in BROKEN_COMPOSE])
def test_broken_compose_files_fail(name, what, breaking):
    doc = load_compose(name)
    breaking(doc)
    assert compose_problems(doc), f"{what}: not caught"


def test_bridge_compose_must_publish_the_pinned_udp_range():
    doc = load_compose("compose.bridge.yaml")
    _gateway(doc)["sysctls"]["net.ipv4.ip_local_port_range"] = "32768 60999"
    assert any("ip_local_port_range" in p for p in compose_problems(doc))
    doc = load_compose("compose.bridge.yaml")
    _gateway(doc)["ports"] = ["8080:8080/tcp", "41000-41399:40000-40399/udp"]  # not 1:1
    assert compose_problems(doc)
    doc = load_compose("compose.yaml")
    _gateway(doc)["ports"] = ["8080:8080"]  # ignored under host networking: a sign of confusion
    assert compose_problems(doc)


# ---------------------------------------------------------------------------
# Kubernetes


def manifests() -> list[dict]:
    docs = []
    for name in sorted(os.listdir(os.path.join(DEPLOY, "k8s"))):
        if name.endswith(".yaml") and name != "rayservice.yaml":  # a KubeRay CRD: tests/deploy/test_rayservice.py
            docs += [d for d in yaml.safe_load_all(read("deploy", "k8s", name)) if d]
    return docs


def _probe_path(container: dict, probe: str) -> str | None:
    return container.get(probe, {}).get("httpGet", {}).get("path")


def _prestop_sleep_s(container: dict) -> float:
    handler = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in handler:
        return float(handler["sleep"]["seconds"])
    cmd = handler.get("exec", {}).get("command", [])
    return float(cmd[1]) if len(cmd) == 2 and cmd[0] == "sleep" else 0.0


def k8s_problems(docs: list[dict]) -> list[str]:
    schema = k8s_schema()
    problems = []
    for doc in docs:
        problems += [f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}: {e}" for e in schema_errors(schema, doc)]
    if problems:
        return problems
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    if not by_kind.get("Deployment") or not by_kind.get("Service"):
        return ["needs a Deployment and a Service"]
    config = {}
    for cm in by_kind.get("ConfigMap", []):
        for key, value in cm.get("data", {}).items():
            if setting_of(key) not in SETTINGS:
                problems.append(f"ConfigMap key {key} is not a Voxgate setting")
            config[key] = value
    dep = _gateway_deployment(by_kind["Deployment"])
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in dep["spec"]["selector"]["matchLabels"].items()):
        problems.append("the Deployment's selector does not match its pod labels")
    spec = pod["spec"]
    container = spec["containers"][0]
    if container.get("command", []) + container.get("args", []) not in ([], SERVE_CMD):
        problems.append(f"the container must run {SERVE_CMD}")
    if _probe_path(container, "readinessProbe") != "/readyz":
        problems.append("the readiness probe must be GET /readyz")
    if _probe_path(container, "livenessProbe") != "/healthz":
        problems.append("the liveness probe must be GET /healthz")
    resources = container.get("resources", {})
    if not all(k in resources.get(kind, {}) for kind in ("requests", "limits") for k in ("cpu", "memory")):
        problems.append("cpu and memory requests and limits are needed")
    env = {e["name"]: e for e in container.get("env", [])}
    for name in env:
        # A helper variable (the pod's IP) is fine when a setting's value expands it: $(NAME).
        helper = setting_of(name) is None and any(f"$({name})" in e.get("value", "") for e in env.values())
        if setting_of(name) not in SETTINGS and not helper:
            problems.append(f"env {name} is not a Voxgate setting")
    drain = float(config.get("VOXGATE_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
    sleep = _prestop_sleep_s(container)
    if sleep <= 0:
        problems.append("a preStop sleep is needed so endpoints stop routing before SIGTERM")
    if spec.get("terminationGracePeriodSeconds", 30) <= sleep + drain:
        problems.append(f"terminationGracePeriodSeconds must exceed preStop sleep {sleep} + drain {drain}")
    security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
    if not security.get("runAsNonRoot") or security.get("runAsUser", 0) == 0:
        problems.append("the pod must run as a non-root user")
    sysctls = {s["name"] for s in spec.get("securityContext", {}).get("sysctls", [])}
    if not spec.get("hostNetwork") and "net.ipv4.ip_local_port_range" not in sysctls:
        problems.append("UDP media: hostNetwork, or the ip_local_port_range sysctl (with TURN) is needed")
    if spec.get("hostNetwork") and spec.get("dnsPolicy") != "ClusterFirstWithHostNet":
        problems.append("with hostNetwork, dnsPolicy ClusterFirstWithHostNet keeps cluster DNS")
    for svc in by_kind["Service"]:
        selector = svc["spec"].get("selector", {})
        selected = [d for d in by_kind["Deployment"]
                    if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())]
        if not selected:
            problems.append(f"Service {svc['metadata']['name']} selects no pod")
            continue
        ports = selected[0]["spec"]["template"]["spec"]["containers"][0].get("ports", [])
        port_names = {p.get("name") for p in ports} | {p["containerPort"] for p in ports}
        for port in svc["spec"].get("ports", []):
            if port.get("targetPort", port["port"]) not in port_names:
                problems.append(f"Service port {port.get('name')} targets a port the container does not have")
    for other in by_kind["Deployment"]:
        if other is not dep:
            problems += _side_deployment_problems(other)
    problems += _fleet_problems({**config, **{k: e.get("value", "") for k, e in env.items()}}, container, by_kind)
    return problems


def _gateway_deployment(deployments: list[dict]) -> dict:
    return next((d for d in deployments if d["metadata"]["name"] == "voxgate"), deployments[0])


def _side_deployment_problems(dep: dict) -> list[str]:
    """What a Deployment beside the gateway (Redis) needs: limits, a non-root user, readiness."""
    name, spec = dep["metadata"]["name"], dep["spec"]["template"]["spec"]
    container = spec["containers"][0]
    problems = []
    resources = container.get("resources", {})
    if not all(k in resources.get(kind, {}) for kind in ("requests", "limits") for k in ("cpu", "memory")):
        problems.append(f"{name}: cpu and memory requests and limits are needed")
    security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
    if not security.get("runAsNonRoot") or security.get("runAsUser", 0) == 0:
        problems.append(f"{name}: must run as a non-root user")
    if "readinessProbe" not in container:
        problems.append(f"{name}: needs a readiness probe")
    return problems


def _fleet_problems(settings: dict[str, str], container: dict, by_kind: dict) -> list[str]:
    """With a session directory: Redis is a Service of these manifests, and each pod
    advertises its own address, taken from the downward API."""
    redis_url = settings.get("VOXGATE_REDIS_URL")
    if not redis_url:
        return []
    problems = []
    url = urlsplit(redis_url)
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    if url.hostname not in services:
        problems.append(f"VOXGATE_REDIS_URL names {url.hostname}, which is no Service here")
    elif (url.port or 6379) not in [p["port"] for p in services[url.hostname]["spec"]["ports"]]:
        problems.append(f"VOXGATE_REDIS_URL's port is not a port of Service {url.hostname}")
    env = container.get("env", [])
    names = [e["name"] for e in env]
    if "VOXGATE_ADVERTISE_URL" not in names:
        return problems + ["VOXGATE_REDIS_URL needs each pod's VOXGATE_ADVERTISE_URL"]
    at = names.index("VOXGATE_ADVERTISE_URL")
    value = env[at].get("value", "")
    for ref in re.findall(r"\$\((\w+)\)", value):
        # Kubernetes expands $(NAME) only from variables defined before it.
        source = next((e for e in env[:at] if e["name"] == ref), None)
        if source is None:
            problems.append(f"VOXGATE_ADVERTISE_URL expands $({ref}), which is not defined before it")
        elif source.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") not in ("status.podIP", "status.hostIP"):
            problems.append(f"$({ref}) must be the pod's own address (fieldRef status.podIP)")
    if not re.fullmatch(r"https?://\$\(\w+\):\d+", value):
        problems.append("VOXGATE_ADVERTISE_URL must be http://$(POD_IP):PORT, this pod's own address")
    elif int(value.rsplit(":", 1)[1]) != int(settings.get("VOXGATE_PORT", Settings().port)):
        problems.append("VOXGATE_ADVERTISE_URL's port must be VOXGATE_PORT")
    if url.hostname in services:
        problems += _directory_guard_problems(services[url.hostname], container, by_kind)
    return problems


def _secret_ref(env: list[dict], name: str) -> tuple | None:
    ref = next((e for e in env if e["name"] == name), {}).get("valueFrom", {}).get("secretKeyRef")
    return (ref.get("name"), ref["key"]) if ref else None


def _directory_guard_problems(service: dict, gateway: dict, by_kind: dict) -> list[str]:
    """Redis requires the password the gateways take from the same Secret key, and a
    NetworkPolicy admits only the gateways (by pod, or a node network's ipBlock)."""
    selector = service["spec"].get("selector", {})
    redis = next((d for d in by_kind["Deployment"]
                  if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())), None)
    if redis is None:
        return []
    problems = []
    container = redis["spec"]["template"]["spec"]["containers"][0]
    args = container.get("command", []) + container.get("args", [])
    given = _secret_ref(gateway.get("env", []), "VOXGATE_REDIS_PASSWORD")
    if given is None:
        problems.append("the gateways need VOXGATE_REDIS_PASSWORD from a Secret")
    if "--requirepass" not in args or args.index("--requirepass") + 1 >= len(args):
        problems.append("redis must require a password (--requirepass)")
    else:
        ref = re.fullmatch(r"\$\((\w+)\)", args[args.index("--requirepass") + 1])
        if ref is None or _secret_ref(container.get("env", []), ref.group(1)) != given:
            problems.append("redis's --requirepass must be $(VAR), VAR from the Secret key of VOXGATE_REDIS_PASSWORD")
    labels = redis["spec"]["template"]["metadata"]["labels"]
    gateway_labels = _gateway_deployment(by_kind["Deployment"])["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in by_kind.get("NetworkPolicy", [])
                if all(labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        problems.append("a NetworkPolicy must limit who reaches redis")
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if not peers:
                problems.append(f"NetworkPolicy {policy['metadata']['name']} lets every pod reach redis")
            for peer in peers or []:
                pods = peer.get("podSelector", {}).get("matchLabels")
                if "podSelector" in peer and (not pods or any(gateway_labels.get(k) != v for k, v in pods.items())):
                    problems.append(f"NetworkPolicy {policy['metadata']['name']} lets pods other than the gateways reach redis")
                if "namespaceSelector" in peer and "podSelector" not in peer:
                    problems.append(f"NetworkPolicy {policy['metadata']['name']} lets whole namespaces reach redis")
    return problems


def test_kubernetes_manifests_are_valid_and_fit_the_drain():
    jsonschema.Draft202012Validator.check_schema(k8s_schema())
    docs = manifests()
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "ConfigMap", "NetworkPolicy"}
    assert k8s_problems(docs) == []


def test_pod_user_is_the_images_user():
    dep = next(d for d in manifests() if d["kind"] == "Deployment")
    uid = dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    for name, _ in DOCKERFILES:
        users = [i.args for i in parse_dockerfile(read("deploy", name)) if i.cmd == "USER"]
        assert users[-1].split(":")[0] == str(uid)


def _dep(docs):
    return _gateway_deployment([d for d in docs if d["kind"] == "Deployment"])


def _redis(docs, kind):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == "voxgate-redis")


def _env(docs, name):
    return next(e for e in _ctr(docs)["env"] if e["name"] == name)


def _ctr(docs):
    return _dep(docs)["spec"]["template"]["spec"]["containers"][0]


BROKEN_K8S = [
    ("probe field typo", lambda d: _ctr(d).__setitem__("readinesProbe", _ctr(d).pop("readinessProbe"))),
    ("replicas as a string", lambda d: _dep(d)["spec"].__setitem__("replicas", "3")),
    ("bad dnsPolicy", lambda d: _dep(d)["spec"]["template"]["spec"].__setitem__("dnsPolicy", "HostNet")),
    ("bad quantity", lambda d: _ctr(d)["resources"]["limits"].__setitem__("memory", "4 gigs")),
    ("unknown kind", lambda d: d.append({"apiVersion": "v1", "kind": "Servce", "metadata": {"name": "x"}})),
    ("wrong apiVersion", lambda d: _dep(d).__setitem__("apiVersion", "v1")),
    ("readiness on healthz", lambda d: _ctr(d)["readinessProbe"]["httpGet"].__setitem__("path", "/healthz")),
    ("no liveness", lambda d: _ctr(d).pop("livenessProbe")),
    ("grace too short", lambda d: _dep(d)["spec"]["template"]["spec"].__setitem__("terminationGracePeriodSeconds", 20)),
    ("no preStop", lambda d: _ctr(d).pop("lifecycle")),
    ("no resources", lambda d: _ctr(d).pop("resources")),
    ("root", lambda d: _dep(d)["spec"]["template"]["spec"]["securityContext"].__setitem__("runAsUser", 0)),
    ("no hostNetwork nor sysctl", lambda d: _dep(d)["spec"]["template"]["spec"].pop("hostNetwork")),
    ("unknown setting", lambda d: next(x for x in d if x["kind"] == "ConfigMap")["data"].__setitem__("VOXGATE_MAX_SESSION", "1")),
    ("service misses pods", lambda d: next(x for x in d if x["kind"] == "Service")["spec"]["selector"].__setitem__("app.kubernetes.io/name", "vg")),
    ("service targets no port", lambda d: next(x for x in d if x["kind"] == "Service")["spec"]["ports"][0].__setitem__("targetPort", "web")),
    ("redis url names no service", lambda d: next(x for x in d if x["kind"] == "ConfigMap")["data"].__setitem__("VOXGATE_REDIS_URL", "redis://redis:6379/0")),
    ("redis url on a wrong port", lambda d: next(x for x in d if x["kind"] == "ConfigMap")["data"].__setitem__("VOXGATE_REDIS_URL", "redis://voxgate-redis:6380/0")),
    ("no advertise url", lambda d: _ctr(d)["env"].remove(_env(d, "VOXGATE_ADVERTISE_URL"))),
    ("advertise url from nowhere", lambda d: _env(d, "VOXGATE_ADVERTISE_URL").__setitem__("value", "http://$(MY_IP):8080")),
    ("advertise url on another port", lambda d: _env(d, "VOXGATE_ADVERTISE_URL").__setitem__("value", "http://$(POD_IP):9090")),
    ("pod IP defined after its use", lambda d: _ctr(d)["env"].append(_ctr(d)["env"].pop(_ctr(d)["env"].index(_env(d, "POD_IP"))))),
    ("advertised address not the pod's", lambda d: _env(d, "POD_IP")["valueFrom"]["fieldRef"].__setitem__("fieldPath", "metadata.name")),
    ("redis as root", lambda d: _redis(d, "Deployment")["spec"]["template"]["spec"]["securityContext"].__setitem__("runAsUser", 0)),
    ("redis without limits", lambda d: _redis(d, "Deployment")["spec"]["template"]["spec"]["containers"][0].pop("resources")),
    ("redis service misses pods", lambda d: _redis(d, "Service")["spec"]["selector"].__setitem__("app.kubernetes.io/name", "redis")),
    ("redis without a password", lambda d: _redis_ctr(d).__setitem__("args", _redis_ctr(d)["args"][:-2])),
    ("redis password from elsewhere", lambda d: _redis_ctr(d)["env"][0]["valueFrom"]["secretKeyRef"].__setitem__("key", "other")),
    ("gateways without the redis password", lambda d: _ctr(d)["env"].remove(_env(d, "VOXGATE_REDIS_PASSWORD"))),
    ("no network policy", lambda d: d.remove(_redis(d, "NetworkPolicy"))),
    ("policy admits every pod", lambda d: _redis(d, "NetworkPolicy")["spec"]["ingress"][0].pop("from")),
    ("policy admits other pods", lambda d: _redis(d, "NetworkPolicy")["spec"]["ingress"][0]["from"][0]["podSelector"].__setitem__("matchLabels", {"app": "x"})),
    ("policy field typo", lambda d: _redis(d, "NetworkPolicy")["spec"].__setitem__("podSelecter", {})),
]


def _redis_ctr(docs):
    return _redis(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("what, breaking", BROKEN_K8S, ids=[b[0] for b in BROKEN_K8S])
def test_broken_manifests_fail(what, breaking):
    docs = copy.deepcopy(manifests())
    breaking(docs)
    assert k8s_problems(docs), f"{what}: not caught"


def test_without_host_network_the_sysctl_and_turn_are_the_way():
    docs = copy.deepcopy(manifests())
    spec = _dep(docs)["spec"]["template"]["spec"]
    spec.pop("hostNetwork")
    spec["dnsPolicy"] = "ClusterFirst"
    spec["securityContext"]["sysctls"] = [{"name": "net.ipv4.ip_local_port_range", "value": "40000 40399"}]
    assert k8s_problems(docs) == []
