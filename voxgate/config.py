"""Gateway settings: one dataclass, filled from CLI flags and VOXGATE_* environment variables.

Every flag `--some-name` also reads `VOXGATE_SOME_NAME`; a flag given on the
command line wins over the environment. Repeatable flags take a
comma-separated list from the environment.

Secrets (API keys, the token and TURN secrets, the Twilio auth token) can come
from a file too (`--api-key-file`, ...), so they never show in `ps`; a secret
given as a command-line flag is accepted with a warning.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from .engine.base import DEFAULT_PRIOR_PRECISION, PRIOR_PRECISIONS  # light: numpy only
from .engine.other_load import SPIN_POLICIES  # light: imports nothing of onnxruntime
from .gateway.fec import SIGNAL_POLICIES  # light: imports no aiortc
from .gateway.heap import YOUNG_THRESHOLD_RANGE  # light: the standard library
from .gateway.encode_pool import parse_threads  # light: the standard library
from .gateway.priority import MEDIA_PRIORITIES  # light: os and logging

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
RTP_SENDERS = ("voxgate", "aiortc")  # gateway/rtp_send.py
# Settings that hold secrets: each also has a `<name>_file` setting.
SECRETS = ("api_key", "token_secret", "turn_secret", "twilio_auth_token")


class ConfigError(ValueError):
    """A setting that cannot work; the message says what to do."""


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    # ICE
    ice_host: list[str] = field(default_factory=list)
    ice_server: list[str] = field(default_factory=list)
    ice_allow: list[str] = field(default_factory=list)
    # Speech
    engine: str = "piper"
    voice: str | None = None
    voice_dir: str | None = None
    device: str = "auto"
    engine_parallel: int = 0  # 0: chosen per engine
    engine_threads: int = 0  # 0: chosen per engine
    engine_spin: str = "auto"
    engine_prior_precision: str = DEFAULT_PRIOR_PRECISION
    first_unit_timeout_ms: int = 350
    # An engine pool (engine/pool.py) to synthesize on instead of a local worker.
    engine_url: str | None = None
    # Send streams straight to the pool's replicas when it lists them (Serve's direct ingress).
    engine_direct: bool = True
    # Outbound Opus
    opus_bitrate: int = 32000
    opus_fec: bool = True
    opus_dtx: bool = False
    opus_dtx_when_asked: bool = True
    opus_complexity: int = 0
    opus_signal: str = "auto"
    # Who builds the speech track's RTP packets (gateway/rtp_send.py).
    rtp_sender: str = "voxgate"
    # How the OS schedules the event loop and the threads it waits on (gateway/priority.py).
    media_priority: str = "normal"
    # Threads that resample and encode speech; 0, the default: on the event loop (gateway/encode_pool.py).
    encode_threads: str = "0"
    # At the latest, seconds between full garbage collections; 0: CPython's own schedule (gateway/heap.py).
    full_gc_interval_s: float = 300.0
    # New container objects between young garbage collections; 0: CPython's default (gateway/heap.py).
    gc_young_threshold: int = 200
    # Barge-in defaults for new sessions
    vad: bool = True
    vad_aggressiveness: int = 2
    vad_min_speech_ms: int = 200
    # Sessions and limits
    max_sessions: int = 200
    max_sessions_per_key: int = 50
    idle_timeout_s: float = 300.0
    session_lifetime_s: float = 3600.0
    max_text_chars: int = 4000  # per message
    max_utterance_chars: int = 20000
    max_message_bytes: int = 65536
    max_messages_per_s: float = 200.0
    max_queued_utterances: int = 32
    drain_timeout_s: float = 10.0
    connect_timeout_s: float = 20.0
    max_sessions_per_address: int = 10
    max_anonymous_sessions: int = 0  # 0: half of --max-sessions with API keys, all without
    trusted_proxy: list[str] = field(default_factory=list)
    tts_max_concurrent: int = 4
    tts_max_concurrent_per_key: int = 2
    tts_max_audio_s: float = 300.0
    telephony_start_timeout_s: float = 10.0
    # Access
    api_key: list[str] = field(default_factory=list)
    api_key_file: str | None = None
    allow_no_auth: bool = False
    allowed_host: list[str] = field(default_factory=list)
    public_url: str | None = None
    token_secret: str | None = None
    token_secret_file: str | None = None
    require_token: bool = False
    token_ttl_s: int = 300
    cors_origin: list[str] = field(default_factory=list)
    turn_secret: str | None = None
    turn_secret_file: str | None = None
    turn_ttl_s: int = 600
    twilio_auth_token: str | None = None
    twilio_auth_token_file: str | None = None
    web: bool = True
    # Fleet: the session directory in Redis (signaling/fleet.py); off without --redis-url.
    redis_url: str | None = None
    advertise_url: str | None = None
    directory_ttl_s: float = 15.0
    log_level: str = "INFO"
    log_json: bool = False

    @property
    def loopback(self) -> bool:
        """Whether the server listens on loopback only."""
        if self.host in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def anonymous_budget(self) -> int:
        """Sessions that may exist without a key or token (offers and calls that make their own)."""
        if self.max_anonymous_sessions > 0:
            return min(self.max_anonymous_sessions, self.max_sessions)
        return self.max_sessions // 2 if self.api_key else self.max_sessions

    @property
    def allowed_hosts(self) -> list[str]:
        """Host names the server answers to (DNS-rebinding defence); ['*'] for any."""
        if self.allowed_host:
            return [h.lower() for h in self.allowed_host]
        if self.loopback:
            return [*LOOPBACK_NAMES, self.host.lower()]
        return ["*"]

    def check(self) -> None:
        """Refuse settings that would expose the server; raises ConfigError saying what to do."""
        if not self.loopback and not self.api_key and not self.allow_no_auth:
            raise ConfigError(
                f"refusing to listen on {self.host} without an API key: anyone who reaches that address "
                "could create sessions, read them and use the engine. Set keys with --api-key-file FILE "
                "or VOXGATE_API_KEY (and consider --require-token), or pass --allow-no-auth to serve "
                "it open on purpose."
            )
        if self.engine_spin not in SPIN_POLICIES:
            raise ConfigError(f"--engine-spin {self.engine_spin!r}: choose one of {', '.join(SPIN_POLICIES)}")
        if self.engine_prior_precision not in PRIOR_PRECISIONS:
            raise ConfigError(
                f"--engine-prior-precision {self.engine_prior_precision!r}: choose one of {', '.join(PRIOR_PRECISIONS)}"
            )
        if self.opus_signal not in SIGNAL_POLICIES:
            raise ConfigError(f"--opus-signal {self.opus_signal!r}: choose one of {', '.join(SIGNAL_POLICIES)}")
        if self.rtp_sender not in RTP_SENDERS:
            raise ConfigError(f"--rtp-sender {self.rtp_sender!r}: choose one of {', '.join(RTP_SENDERS)}")
        if self.media_priority not in MEDIA_PRIORITIES:
            raise ConfigError(f"--media-priority {self.media_priority!r}: choose one of {', '.join(MEDIA_PRIORITIES)}")
        try:
            parse_threads(self.encode_threads)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not (math.isfinite(self.full_gc_interval_s) and (self.full_gc_interval_s == 0 or 1.0 <= self.full_gc_interval_s <= 86400.0)):
            raise ConfigError(
                f"--full-gc-interval-s {self.full_gc_interval_s!r}: give seconds from 1 to 86400, or 0 to leave full "
                "garbage collections to CPython's own schedule"
            )
        if not isinstance(self.gc_young_threshold, int) or isinstance(self.gc_young_threshold, bool) or not (
                self.gc_young_threshold == 0 or YOUNG_THRESHOLD_RANGE[0] <= self.gc_young_threshold <= YOUNG_THRESHOLD_RANGE[1]):
            raise ConfigError(
                f"--gc-young-threshold {self.gc_young_threshold!r}: give a count of new objects from "
                f"{YOUNG_THRESHOLD_RANGE[0]} to {YOUNG_THRESHOLD_RANGE[1]}, or 0 to keep CPython's young collections"
            )
        self._check_fleet()
        if self.engine_url is not None:
            parsed = urlsplit(self.engine_url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ConfigError(
                    f"--engine-url {self.engine_url!r} is not an http(s) URL; give the pool's Serve ingress, "
                    "e.g. http://pool:8000/"
                )
        for value in self.trusted_proxy:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise ConfigError(f"--trusted-proxy {value!r} is not a network; use CIDR such as 10.0.0.0/8") from None

    def _check_fleet(self) -> None:
        if not self.redis_url:
            return
        if urlsplit(self.redis_url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"--redis-url {self.redis_url!r} is not a Redis URL; use redis://HOST:PORT/DB (or rediss:// for TLS)")
        if not self.advertise_url:
            raise ConfigError(
                "--redis-url needs --advertise-url (VOXGATE_ADVERTISE_URL): the URL the other gateways reach this one "
                "at, e.g. http://10.0.0.5:8080; in Kubernetes, http://$(POD_IP):8080 from the downward API"
            )
        url = urlsplit(self.advertise_url)
        if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/") or url.query:
            raise ConfigError(
                f"--advertise-url {self.advertise_url!r} must be this gateway's own base URL, http(s)://HOST:PORT, "
                "with no path; the other gateways send it the requests about its sessions"
            )
        if not (math.isfinite(self.directory_ttl_s) and self.directory_ttl_s >= 1.0):
            raise ConfigError("--directory-ttl-s must be at least 1 second; records are refreshed every third of it")

    @property
    def parallel(self) -> int:
        # The torch engine batches streams into one pass, so it wants one pass at
        # a time with every core; onnxruntime voices run one synthesis per core.
        if self.engine_parallel:
            return self.engine_parallel
        return 1 if self.engine == "torch" else (os.cpu_count() or 1)

    @property
    def threads(self) -> int:
        # The most threads one synthesis step may use. Every core: torch runs each
        # batched pass on all of them; piper uses all of them for a step that runs
        # alone and urgent (a first window) and one per step under load.
        if self.engine_threads:
            return self.engine_threads
        return os.cpu_count() or 1


_HELP = {
    "host": "address the HTTP server listens on",
    "port": "port the HTTP server listens on",
    "ice_host": "offer only this local address as ICE host candidate (repeatable; default: every interface)",
    "ice_server": "STUN/TURN server URL, e.g. turn:user:pass@turn.example.com:3478 (repeatable; default none)",
    "ice_allow": "network remote ICE candidates may come from, CIDR or 'public' (repeatable; default: public "
    "addresses plus the networks of --ice-host)",
    "engine": "speech engine: piper (embedded voice), tone (test engine), torch, cosyvoice2",
    "voice": "default voice: 'joe' (embedded), a voice of --voice-dir, or the path of a Piper .onnx voice",
    "voice_dir": "directory of Piper .onnx voices (with their .onnx.json) clients may choose by name",
    "device": "where the engine runs: auto, cpu or cuda",
    "engine_parallel": "synthesis steps the worker runs at once (0: one per core; 1 for torch, which batches)",
    "engine_threads": "most intra-op threads one synthesis step may use (0: every core; piper gives them to a "
    "step that runs alone and one each to steps under load)",
    "engine_spin": "piper, in the local worker: whether onnxruntime's threads spin between the ops of a step on every "
    "core: auto (when that step runs alone and other processes keep at most 0.35 of a core busy: about a tenth off a "
    "long sentence's first chunk on an idle machine, where spinning beside a busy process made it 1.5x slower; costs "
    "a second copy of the every-core sessions' memory), always, or never (an engine pool, --engine-url, runs auto)",
    "engine_prior_precision": "piper on the CPU, in the local worker: int8 runs the prior's convolutions as "
    "8-bit integer products (the prior, which a sentence's first audio waits for; the flow and decoder that make the "
    "audio stay float32), checked against float32 when a voice loads, which adds under a second to it; float32 keeps "
    "the prior in float32 (an engine pool, --engine-url, runs int8)",
    "first_unit_timeout_ms": "speak the first words after this long even without a clause boundary",
    "engine_url": "URL of an engine pool on Ray Serve (`voxgate engine serve`, a KubeRay RayService), e.g. "
    "http://pool:8000/: synthesis runs there instead of in a local worker process (--engine, --voice and "
    "--device are then the pool's settings)",
    "engine_direct": "with --engine-url: send each stream straight to a pool replica that listens itself (Serve's "
    "direct ingress, which `voxgate engine serve` turns on), skipping the proxy's hop; the proxy still serves "
    "when the pool lists no replicas or one cannot be reached",
    "opus_bitrate": "outbound Opus bitrate in bit/s",
    "opus_fec": "Opus in-band forward error correction",
    "opus_dtx": "Opus discontinuous transmission for every listener, inside utterances too (libopus DTX)",
    "opus_dtx_when_asked": "between utterances, send a silent keep-alive every 400 ms instead of silence every 20 ms "
    "to listeners whose offer asks for DTX (usedtx=1 on its Opus format line, as the bundled page's does)",
    "opus_complexity": "Opus encoder complexity 0..10 (0 costs a third of 5 with the same speech WER: bench/bench_opus_quality.py)",
    "opus_signal": "what libopus codes speech as: music (CELT alone, a third of voice's cost per frame, the same speech "
    "WER, no in-band FEC), voice (SILK or hybrid, with in-band FEC), or auto: music while the listener's RTCP reports "
    "show no loss, voice from a report of 1 %% or more until 30 s after the last (with --no-opus-fec, auto is music)",
    "rtp_sender": "who builds the speech track's RTP packets: voxgate (a header template per sender, a "
    "fraction of aiortc's cost per frame) or aiortc (aiortc's own sender loop)",
    "media_priority": "how the OS schedules the event loop and the threads it waits on (the engine "
    "reader, /v1/tts formatting, and encoding threads with --encode-threads N): normal, or realtime (SCHED_FIFO at a low priority, so a woken loop gets a core at "
    "once while other threads keep the cores busy; the engine worker stays normal; needs a real-time limit of 10, "
    "e.g. docker run --ulimit rtprio=10 or ulimit -r 10, or CAP_SYS_NICE; keep --max-sessions within capacity, "
    "since these threads come before synthesis)",
    "encode_threads": "where speech is resampled and Opus-encoded: 0 (the default) on the event loop, whenever no "
    "other callback waits; or on threads shared by every session: a count up to 64, or auto (one per core beyond the "
    "event loop's, at least one), for one process that must use many cores (more CPU per session and more late "
    "frames on 2 cores: docs/scaling.md)",
    "full_gc_interval_s": "the longest time between full garbage collections, which stop every session's frames while "
    "they run (35-151 ms at 80 sessions): the gateway runs one after 64 sessions close, when the last open one closes, "
    "and at the latest after this many seconds, instead of when CPython's heuristic fires in the middle of speech; "
    "0 leaves them to CPython (docs/scaling.md)",
    "gc_young_threshold": "a young garbage collection (generation 0; generation 1 every 5th, before Python 3.14) "
    "after this many more container objects were made than freed: each walks every young object still alive, and the "
    "sessions' churn grows that set far past the count, so with CPython's 700 one took 5-10 ms with a tick's frames "
    "behind it at 200-280 conversations on 2 cores with --media-priority realtime; smaller is shorter and more often; 0 keeps CPython's thresholds "
    "(700 and 10, or 2000 and 10 from Python 3.13) (docs/scaling.md)",
    "vad": "barge-in by voice on for new sessions",
    "vad_aggressiveness": "webrtcvad mode 0..3 for new sessions",
    "vad_min_speech_ms": "speech needed before a barge-in fires",
    "max_sessions": "concurrent sessions in total; more are refused with 503",
    "max_sessions_per_key": "concurrent sessions per API key",
    "idle_timeout_s": "close a session after this long without messages or audio",
    "session_lifetime_s": "close a session after this long in any case",
    "max_text_chars": "characters of text per message",
    "max_utterance_chars": "characters of text per utterance",
    "max_message_bytes": "bytes per data-channel or WebSocket message",
    "max_messages_per_s": "messages per second per connection",
    "max_queued_utterances": "utterances waiting per session",
    "drain_timeout_s": "on SIGTERM, how long current utterances may finish",
    "connect_timeout_s": "close a WebRTC session whose peer has not connected after this long",
    "max_sessions_per_address": "sessions one client address may make without a key or token (0: no limit; "
    "loopback clients are not limited: behind a local proxy, set --trusted-proxy)",
    "max_anonymous_sessions": "sessions made without a key or token, in total (0: half of --max-sessions "
    "when API keys are set, else all)",
    "trusted_proxy": "network of a reverse proxy whose X-Forwarded-For names the client (repeatable)",
    "tts_max_concurrent": "POST /v1/tts requests synthesizing at once, in total",
    "tts_max_concurrent_per_key": "POST /v1/tts requests at once per API key (per client address without keys)",
    "tts_max_audio_s": "seconds of audio one POST /v1/tts request may produce",
    "telephony_start_timeout_s": "close a Twilio stream that has not sent 'start' after this long",
    "api_key": "API key for backend endpoints (repeatable); prefer VOXGATE_API_KEY or --api-key-file, "
    "since flags show in ps",
    "api_key_file": "file with one API key per line",
    "allow_no_auth": "allow listening on a non-loopback address without an API key",
    "allowed_host": "host name the server answers to (repeatable; default: loopback names when bound to "
    "loopback, else any)",
    "public_url": "the URL clients reach this server at, e.g. https://voice.example.com (Twilio signatures)",
    "token_secret": "secret that signs browser tokens (default: random per process)",
    "token_secret_file": "file holding --token-secret",
    "require_token": "browsers need a token from POST /v1/sessions to connect",
    "token_ttl_s": "lifetime of browser tokens",
    "cors_origin": "Origin allowed to call the HTTP API from a browser (repeatable; default: same origin)",
    "turn_secret": "coturn REST-auth shared secret; enables short-lived TURN credentials",
    "turn_secret_file": "file holding --turn-secret",
    "twilio_auth_token": "Twilio auth token: when set, X-Twilio-Signature is verified on telephony streams",
    "twilio_auth_token_file": "file holding --twilio-auth-token",
    "turn_ttl_s": "lifetime of issued TURN credentials",
    "web": "serve the bundled page at /",
    "redis_url": "Redis holding the fleet's session directory, redis://HOST:PORT/DB; any gateway then answers "
    "about any session (default: none, a standalone gateway)",
    "advertise_url": "this gateway's base URL as the other gateways reach it, e.g. http://10.0.0.5:8080 "
    "(required with --redis-url)",
    "directory_ttl_s": "a directory record outlives its gateway by at most this long; refreshed every third of it",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_json": "structured JSON log lines",
}


def _env_name(name: str, prefix: str = "VOXGATE_") -> str:
    return prefix + name.upper()


def _parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean; use true or false")


def add_arguments(parser: argparse.ArgumentParser, kind: type = None) -> None:
    kind = kind or Settings
    helps, prefix = _SCHEMES[kind]
    defaults = kind()
    for f in fields(kind):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help_text = helps.get(f.name, "") + f" [env {_env_name(f.name, prefix)}]"
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif isinstance(default, list):
            parser.add_argument(flag, dest=f.name, action="append", default=None, help=help_text)
        else:
            arg_type = type(default) if default is not None else str
            parser.add_argument(flag, dest=f.name, type=arg_type, default=None, help=help_text + f" (default {default})")


def settings_from(args: argparse.Namespace | None = None, environ: dict | None = None, kind: type = None):
    kind = kind or Settings
    _, prefix = _SCHEMES[kind]
    environ = os.environ if environ is None else environ
    settings = kind()
    for f in fields(kind):
        value = getattr(args, f.name, None) if args is not None else None
        env = _env_name(f.name, prefix)
        if value is None and env in environ:
            raw = environ[env]
            current = getattr(settings, f.name)
            try:
                if isinstance(current, bool):
                    value = _parse_bool(raw)
                elif isinstance(current, list):
                    value = [v.strip() for v in raw.split(",") if v.strip()]
                elif isinstance(current, int):
                    value = int(raw)
                elif isinstance(current, float):
                    value = float(raw)
                else:
                    value = raw
            except ValueError as exc:
                raise SystemExit(f"{env}={raw!r}: {exc}") from None
        if value is not None:
            setattr(settings, f.name, value)
    if kind is Settings:
        _read_secret_files(settings)
    return settings


def _read_secret_files(settings: Settings) -> None:
    for name in SECRETS:
        path = getattr(settings, name + "_file")
        if not path:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f.read().splitlines() if line.strip() and not line.startswith("#")]
        except OSError as exc:
            raise SystemExit(f"--{name.replace('_', '-')}-file {path}: {exc.strerror or exc}") from None
        if not lines:
            raise SystemExit(f"--{name.replace('_', '-')}-file {path} is empty; put the secret in it")
        if name == "api_key":
            settings.api_key = [*settings.api_key, *lines]
        else:
            setattr(settings, name, lines[0])


def secrets_on_command_line(argv: list[str]) -> list[str]:
    """Secret flags given on the command line, where every user of the machine can read them."""
    flags = {"--" + name.replace("_", "-") for name in SECRETS}
    return sorted({arg.split("=", 1)[0] for arg in argv if arg.split("=", 1)[0] in flags})


@dataclass
class PoolSettings:
    """`voxgate engine serve`: a local engine pool on Ray Serve (engine/pool.py)."""

    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "piper"
    voice: str | None = None
    voice_dir: str | None = None
    device: str = "auto"
    replica_cpus: float = 1.0
    num_gpus: float = 0.0
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: int = 16
    max_ongoing_requests: int = 64
    ray_cpus: int = 0
    direct_ingress: bool = True

    def check(self) -> None:
        if self.num_gpus < 0 or self.replica_cpus <= 0:
            raise ConfigError("--num-gpus must be >= 0 and --replica-cpus > 0 (fractions share a device)")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ConfigError("need 1 <= --min-replicas <= --max-replicas")
        if not 1 <= self.target_ongoing_requests <= self.max_ongoing_requests:
            raise ConfigError("need 1 <= --target-ongoing-requests <= --max-ongoing-requests")


_POOL_HELP = {
    "host": "address Serve's HTTP ingress listens on (0.0.0.0 in a container)",
    "port": "port of Serve's HTTP ingress; gateways use --engine-url http://HOST:PORT/",
    "engine": "speech engine each replica hosts: piper, tone (test engine), torch, cosyvoice2",
    "voice": "default voice of each replica",
    "voice_dir": "directory of Piper .onnx voices the replicas offer by name",
    "device": "where each replica's engine runs: auto, cpu or cuda",
    "replica_cpus": "CPUs each replica reserves (its scheduler runs one step per CPU)",
    "num_gpus": "GPU each replica reserves; a fraction (0.25) puts several replicas on one GPU",
    "min_replicas": "replicas kept running",
    "max_replicas": "most replicas the autoscaler starts",
    "target_ongoing_requests": "streams per replica the autoscaler aims for",
    "max_ongoing_requests": "most streams one replica takes at once; more wait in Serve's queue",
    "ray_cpus": "CPUs of the local Ray this command starts (0: every core)",
    "direct_ingress": "each replica also listens itself (Serve's direct ingress, ports from 30000 on --host), so "
    "gateways skip the proxy's hop of about 5 ms a request",
}

_SCHEMES = {Settings: (_HELP, "VOXGATE_"), PoolSettings: (_POOL_HELP, "VOXGATE_POOL_")}
