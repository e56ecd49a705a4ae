"""Voxgate's settings: the one place every setting is defined, and the only module that reads the environment.

Each setting is a field of `Settings` (or `PoolSettings`), written once: its
default, where `--help` lists it, its one-line help, and the values it may
take. Every flag `--some-name` also reads `VOXGATE_SOME_NAME` (the pool's,
`VOXGATE_POOL_SOME_NAME`); a flag given on the command line wins over the
environment, and repeatable flags take a comma-separated list from it.
`check()` refuses any value outside its range before anything loads; the
command line exits with status 2, naming the flag and its range.

The modules that act on a setting take their defaults and choices from here,
so this module imports nothing of the product: configuration is a leaf.

Secrets (API keys, the token and TURN secrets, the Twilio auth token) can come
from a file too (`--api-key-file`, ...), so they never show in `ps`; a secret
given as a command-line flag is accepted with a warning.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, fields
from collections.abc import Mapping
from urllib.parse import urlsplit

from .config_fields import (
    ConfigError, HelpFormatter, add_flag, check_ranges, flag_of, parse_raw, read_secret_files, setting,
)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Settings that hold secrets: each also has a `<name>_file` setting.
SECRETS = ("api_key", "token_secret", "turn_secret", "twilio_auth_token", "redis_password", "stt_api_key")

# The values some settings choose among; the modules that act on them import these.
ENGINES = ("piper", "tone", "torch", "cosyvoice2")  # engine/registry.py
DEVICES = ("auto", "cpu", "cuda")
SPIN_POLICIES = ("auto", "always", "never")  # engine/other_load.py
PRIOR_PRECISIONS = ("int8", "float32")  # engine/piper/graph_quant.py
SIGNAL_POLICIES = ("auto", "voice", "music")  # gateway/media/fec.py
RTP_SENDERS = ("voxgate", "aiortc")  # gateway/media/rtp_send.py
MEDIA_PRIORITIES = ("normal", "realtime")  # gateway/media/priority.py
STT_ENGINES = ("none", "pocketsphinx", "whisper")  # gateway/caller/stt.py; --stt-url names the other kind
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_ENCODE_THREADS = 64  # gateway/media/encode_pool.py
RATE_RANGE = (0.25, 4.0)  # speaking rates a client (session.update) or `voxgate say --rate` may ask for
# --gc-young-threshold (gateway/heap.py): below 50 a young collection runs every few frames' worth of
# objects; above 100,000 the young set, and so each pause, grows past anything measured.
YOUNG_THRESHOLD_RANGE = (50, 100000)
MIN_INTERRUPT_RANGE = (20, 5000)  # barge_in.min_interrupt_ms, by flag or session.update (gateway/caller/caller_side.py)

# Where `voxgate serve --help` lists a setting, in this order.
LISTENING = "listening"
ACCESS = "access"
VOICE = "voice"
MEDIA = "media"
RECOGNITION = "recognition"
RELAY = "relay"
LIMITS = "limits"
FLEET = "fleet"
TUNING = "tuning"
LOGGING = "logging"
GROUPS = {
    LISTENING: "where HTTP and media listen",
    ACCESS: "who may use the server",
    VOICE: "the engine and its voices",
    MEDIA: "outbound Opus and barge-in",
    RECOGNITION: "the caller's speech as text (speech.transcript)",
    RELAY: "ConversationRelay applications Voxgate connects to (docs/relay.md)",
    LIMITS: "sessions, messages and time",
    FLEET: "several gateways sharing sessions through Redis",
    TUNING: "threads, scheduling and memory; the defaults suit most machines",
    LOGGING: "log lines",
}
SETTINGS_DOC = "docs/settings.md"


def play_origin(url: str) -> str | None:
    """The origin (scheme://host[:port], lower case, no default port) of an http(s) URL, or None if
    it has none. --relay-play-origin must be exactly an origin; gateway/backends/relay_play.py compares with it."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        return None
    scheme = parts.scheme.lower()
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    default = 443 if scheme == "https" else 80
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def threads_or_every_core(threads: int | float | None = 0) -> int:
    """A thread count where 0 (or None) means every core: the one place that rule is resolved."""
    count = int(threads or 0)
    return count if count > 0 else (os.cpu_count() or 1)


@dataclass
class Settings:
    """`voxgate serve`. Each field: setting(default, group, one line of help, range); details in docs/settings.md."""

    host: str = setting("127.0.0.1", LISTENING, "address HTTP listens on (beyond loopback: needs an API key)", metavar="ADDR")
    port: int = setting(8080, LISTENING, "port HTTP listens on", low=1, high=65535, zero="a free one")
    ice_host: list[str] = setting([], LISTENING, "offer only this address for media (repeatable)",
                                  shown="loopback if --host is", metavar="ADDR")
    ice_server: list[str] = setting([], LISTENING, "STUN/TURN URL, e.g. turn:user:pass@host:3478 (repeatable)",
                                    metavar="URL")
    ice_allow: list[str] = setting([], LISTENING, "remote candidates' network: CIDR, public (repeatable)",
                                   shown="public, --ice-host's", metavar="CIDR")
    public_url: str | None = setting(None, LISTENING, "the URL clients reach this server at (Twilio signatures)", metavar="URL")
    web: bool = setting(True, LISTENING, "serve the bundled page at /")
    # Speech
    engine: str = setting("piper", VOICE, "speech engine; tone is a test engine", choices=ENGINES)
    voice: str | None = setting(None, VOICE, "default voice: a name, or a Piper .onnx path",
                                shown="the engine's: joe for piper", metavar="NAME")
    voice_dir: str | None = setting(None, VOICE, "folder of Piper .onnx voices clients may choose by name", metavar="DIR")
    device: str = setting("auto", VOICE, "where the engine runs", choices=DEVICES)
    first_unit_timeout_ms: int = setting(350, VOICE, "speak first words after this long without a clause end",
                                         low=20, high=10000)
    # An engine pool (engine/cluster/pool.py) to synthesize on instead of a local worker.
    engine_url: str | None = setting(None, VOICE, "an engine pool on Ray Serve to synthesize on",
                                     shown="a local worker", metavar="URL")
    # Send streams straight to the pool's replicas when it lists them (Serve's direct ingress).
    engine_direct: bool = setting(True, VOICE, "with --engine-url: streams go straight to the replicas")
    # The cosyvoice2 engine (engine/torch_voices/cosyvoice2.py): a model directory and a zero-shot prompt or a built-in speaker.
    cosyvoice_model: str | None = setting(None, VOICE, "cosyvoice2: the model directory", metavar="DIR")
    cosyvoice_prompt_wav: str | None = setting(None, VOICE, "cosyvoice2: a zero-shot prompt, 16 kHz speech", metavar="FILE")
    cosyvoice_prompt_text: str = setting("", VOICE, "cosyvoice2: the prompt's transcript", metavar="TEXT")
    cosyvoice_speaker: str | None = setting(None, VOICE, "cosyvoice2: a built-in speaker of an SFT model", metavar="NAME")
    # Outbound Opus
    opus_bitrate: int = setting(32000, MEDIA, "outbound Opus bitrate, bit/s", low=6000, high=510000)
    opus_fec: bool = setting(True, MEDIA, "Opus in-band forward error correction (when coded as voice)")
    opus_dtx: bool = setting(False, MEDIA, "libopus DTX for every listener, inside utterances too")
    opus_dtx_when_asked: bool = setting(True, MEDIA, "keep-alives between utterances to listeners asking for DTX")
    opus_complexity: int = setting(0, MEDIA, "Opus encoder complexity", low=0, high=10)
    opus_fec_bitrate: int = setting(48000, MEDIA, "outbound Opus bitrate while in-band FEC is on, bit/s",
                                    low=6000, high=510000)
    opus_loss_pct: int = setting(5, MEDIA, "the loss, %, libopus sizes in-band FEC for", low=0, high=100)
    opus_signal: str = setting("auto", MEDIA, "code speech as music, voice (FEC), or auto: by loss",
                               choices=SIGNAL_POLICIES)
    # Barge-in defaults for new sessions
    vad: bool = setting(True, MEDIA, "barge-in by voice for new sessions")
    vad_aggressiveness: int = setting(2, MEDIA, "webrtcvad mode for new sessions", low=0, high=3)
    vad_min_speech_ms: int = setting(200, MEDIA, "speech heard before speech.started", low=20, high=5000)
    echo_cancel: bool = setting(True, MEDIA, "take the bot's own echo out of the microphone before barge-in")
    # Chosen with bench/bench_barge_in.py (docs/barge-in.md): real interruptions over a -10 dB echo within 300 ms.
    min_interrupt_ms: int = setting(200, MEDIA, "caller speech before it interrupts the bot (else a backchannel)",
                                    low=MIN_INTERRUPT_RANGE[0], high=MIN_INTERRUPT_RANGE[1])
    # Speech recognition on each VAD turn (gateway/caller/stt.py): embedded, or an OpenAI-compatible endpoint.
    stt: str = setting("none", RECOGNITION, "recognize caller turns (speech.transcript)", choices=STT_ENGINES)
    stt_url: str | None = setting(None, RECOGNITION, "or with this OpenAI-compatible /v1/audio/transcriptions API",
                                  metavar="URL")
    stt_model: str = setting("whisper-1", RECOGNITION, "with --stt-url: the model asked for", metavar="NAME")
    stt_api_key: str | None = setting(None, RECOGNITION, "with --stt-url: its API key (ps shows it: use the file)",
                                      metavar="SECRET")
    stt_api_key_file: str | None = setting(None, RECOGNITION, "file holding --stt-api-key", metavar="FILE")
    stt_timeout_s: float = setting(10.0, RECOGNITION, "a turn not recognized by then is an stt_timeout error",
                                   low=0.5, high=600.0)
    stt_max_concurrent: int = setting(2, RECOGNITION, "turns recognized at once, in total", low=1, high=1024)
    stt_max_turn_s: float = setting(30.0, RECOGNITION, "a longer turn is recognized in pieces this long",
                                    low=1.0, high=600.0)
    # The end of a caller's turn as a decision (gateway/caller/endpoint.py), and partial transcripts during it.
    turn_min_silence_ms: int = setting(250, RECOGNITION, "silence that ends a turn that reads as finished",
                                       low=100, high=5000)
    turn_max_silence_ms: int = setting(1200, RECOGNITION, "silence that ends a turn that does not",
                                       low=100, high=10000)
    stt_partial_ms: int = setting(700, RECOGNITION, "a partial transcript at most this often (0: none; whisper)",
                                  low=0, high=10000)
    # ConversationRelay (gateway/backends/relay.py): Voxgate opens a WebSocket to the application, as the vendors do.
    relay_url: str | None = setting(None, RELAY, "relay calls and offers made without one to this ws(s):// app",
                                    metavar="URL")
    relay_allow_private: bool = setting(False, RELAY, "let relay URLs reach loopback and private addresses")
    relay_connect_timeout_s: float = setting(5.0, RELAY, "give up on a relay app not connected by then",
                                             low=0.5, high=60.0)
    relay_read_timeout_s: float = setting(20.0, RELAY, "ping period; a relay app silent to pings this long is gone",
                                          low=1.0, high=600.0)
    relay_max_message_bytes: int = setting(65536, RELAY, "bytes per message from a relay app; larger ends it",
                                           low=1024, high=16777216)
    relay_max_messages_per_s: float = setting(100.0, RELAY, "messages per second from a relay app", low=1.0,
                                              high=10000.0)
    relay_apology: str = setting("Sorry, something went wrong. Goodbye.", RELAY, "said when a relay app fails",
                                 shown="an apology", metavar="TEXT")
    # A relay app's `play` (gateway/backends/relay_play.py): audio fetched from these origins only, bounded.
    relay_play_origin: list[str] = setting([], RELAY, "an origin relay `play` may fetch from (repeatable)",
                                           shown="none", metavar="ORIGIN")
    relay_play_max_bytes: int = setting(8388608, RELAY, "bytes one relay `play` may fetch",
                                        low=65536, high=268435456)
    relay_play_max_s: float = setting(120.0, RELAY, "seconds one relay `play` may last, loops included",
                                      low=1.0, high=3600.0)
    relay_play_timeout_s: float = setting(10.0, RELAY, "a relay `play` not fetched by then is refused",
                                          low=0.5, high=120.0)
    # Sessions and limits
    max_sessions: int = setting(200, LIMITS, "sessions at once, in total; more get 503", low=1, high=100000)
    max_sessions_per_key: int = setting(50, LIMITS, "sessions at once per API key", low=1, high=100000)
    max_anonymous_sessions: int = setting(0, LIMITS, "sessions made without key or token", low=1, high=100000,
                                          zero="half with keys")
    max_sessions_per_address: int = setting(10, LIMITS, "sessions one address may make without a token",
                                            low=1, high=100000, zero="no limit")
    idle_timeout_s: float = setting(300.0, LIMITS, "close a session after this long without activity",
                                    low=1.0, high=86400.0)
    session_lifetime_s: float = setting(3600.0, LIMITS, "close a session after this long in any case", low=1.0, high=604800.0)
    connect_timeout_s: float = setting(20.0, LIMITS, "close a WebRTC session not connected by then",
                                       low=1.0, high=3600.0)
    # A live peer is never this quiet: an idle chromium page sent the gateway something at least every
    # 2.66 s (consent checks, RTCP receiver reports), an idle aiortc client every 1.47 s, an aiortc peer
    # with only a data channel every 4.9 s (consent, every 4-6 s): docs/networks.md. 8 s is over all
    # of these, and a cut path still closes within 10 s (7.9 s measured).
    peer_silence_timeout_s: float = setting(8.0, LIMITS, "close a WebRTC session whose peer sent nothing this long",
                                            low=1.0, high=600.0, zero="off")
    drain_timeout_s: float = setting(10.0, LIMITS, "on SIGTERM, time current utterances may take to finish", low=0.0, high=3600.0)
    max_text_chars: int = setting(4000, LIMITS, "characters of text per message", low=1, high=1000000)
    max_utterance_chars: int = setting(20000, LIMITS, "characters of text per utterance", low=1, high=10000000)
    max_message_bytes: int = setting(65536, LIMITS, "bytes per data-channel or WebSocket message", low=1024, high=16777216)
    max_messages_per_s: float = setting(200.0, LIMITS, "messages per second per connection", low=1.0, high=100000.0)
    max_channel_buffer_kb: int = setting(1024, LIMITS, "unread data-channel events before a close, KiB",
                                         low=16, high=1048576)
    max_queued_utterances: int = setting(32, LIMITS, "utterances waiting per session", low=1, high=10000)
    tts_max_concurrent: int = setting(4, LIMITS, "POST /v1/tts requests synthesizing at once", low=1, high=10000)
    tts_max_concurrent_per_key: int = setting(2, LIMITS, "POST /v1/tts requests at once per key or address",
                                              low=1, high=10000)
    tts_max_audio_s: float = setting(300.0, LIMITS, "audio seconds one POST /v1/tts request may make", low=1.0, high=86400.0)
    tts_ws_max_contexts: int = setting(4, LIMITS, "contexts open at once on one /v1/tts/ws connection", low=1, high=64)
    header_timeout_s: float = setting(10.0, LIMITS, "time a connection has to send its first request head, s",
                                      low=1.0, high=3600.0)
    max_connections: int = setting(1024, LIMITS, "HTTP connections open at once; more get 503", low=16, high=1000000)
    max_connections_per_ip: int = setting(64, LIMITS, "HTTP connections at once per client address",
                                               low=1, high=1000000, zero="no limit")
    telephony_start_timeout_s: float = setting(10.0, LIMITS, "close a Twilio stream without 'start' by then",
                                               low=1.0, high=600.0)
    # What one WebRTC peer's microphone may cost (gateway/media/ssrcs.py, gateway/caller/mic.py; docs/security.md).
    max_ssrcs: int = setting(4, LIMITS, "SSRCs a WebRTC peer may send from; others are dropped unread", low=1, high=64)
    mic_max_packets_per_s: float = setting(200.0, LIMITS, "microphone packets read a second per WebRTC peer",
                                           low=10.0, high=100000.0)
    caller_audio_buffer_ms: int = setting(1000, LIMITS, "caller audio a backend may leave unread (?audio=pcm16)",
                                          low=20, high=10000)
    max_watchers_per_session: int = setting(8, LIMITS, "backend WebSockets on one session at once", low=1, high=10000)
    max_watchers_per_key: int = setting(64, LIMITS, "backend WebSockets on one API key's sessions at once",
                                        low=1, high=100000)
    write_stall_s: float = setting(10.0, LIMITS, "a client that takes nothing sent to it this long is dropped",
                                   low=0.5, high=600.0)
    tts_ws_context_idle_s: float = setting(20.0, LIMITS, "a /v1/tts/ws context with no new text this long ends",
                                           low=1.0, high=3600.0)
    # Admission by measured headroom (gateway/load/admission.py; how to choose them: docs/scaling.md).
    talk_share: float = setting(0.4, LIMITS, "share of the time a conversation is expected to speak", low=0.05, high=1.0)
    ready_margin: float = setting(0.1, LIMITS, "share of the speech budget /readyz keeps free", low=0.0, high=0.5)
    synthesis_budget: float = setting(0.0, LIMITS, "seconds of audio per second the node may speak", low=0.1,
                                      high=100000.0, zero="measured")
    # Sessions that do not speak yet (gateway/load/admission.py; docs/security.md, issue 53).
    unjoined_share: float = setting(0.5, LIMITS, "share of --talk-share a session not yet connected counts",
                                    low=0.0, high=1.0)
    unjoined_hold_s: float = setting(30.0, LIMITS, "how long a session not yet connected counts at all; then 0",
                                     low=1.0, high=3600.0)
    key_reserve: float = setting(0.25, LIMITS, "share of the speech budget sessions without a key may not use",
                                 low=0.0, high=0.9)
    made_ahead_share: float = setting(0.5, LIMITS, "share of the speech budget one key's unjoined sessions may hold",
                                      low=0.05, high=1.0)
    # Access
    api_key: list[str] = setting([], ACCESS, "API key for backends (repeatable; ps shows it: use the file)",
                                 metavar="KEY")
    api_key_file: str | None = setting(None, ACCESS, "file with one API key per line", metavar="FILE")
    allow_no_auth: bool = setting(False, ACCESS, "listen beyond loopback without an API key")
    allowed_host: list[str] = setting([], ACCESS, "host name the server answers to (repeatable)",
                                      shown="loopback's if --host is", metavar="NAME")
    trusted_proxy: list[str] = setting([], ACCESS, "proxy whose X-Forwarded-For names the client (repeatable)",
                                       metavar="CIDR")
    cors_origin: list[str] = setting([], ACCESS, "browser Origin allowed to call the API (repeatable)",
                                     shown="same origin", metavar="ORIGIN")
    require_token: bool = setting(False, ACCESS, "browsers need a client token from POST /v1/sessions")
    token_secret: str | None = setting(None, ACCESS, "secret that signs client tokens", shown="random per process",
                                       metavar="SECRET")
    token_secret_file: str | None = setting(None, ACCESS, "file holding --token-secret", metavar="FILE")
    token_ttl_s: int = setting(300, ACCESS, "lifetime of client tokens, s", low=10, high=604800)
    turn_secret: str | None = setting(None, ACCESS, "coturn REST secret: short-lived TURN credentials", metavar="SECRET")
    turn_secret_file: str | None = setting(None, ACCESS, "file holding --turn-secret", metavar="FILE")
    turn_ttl_s: int = setting(600, ACCESS, "lifetime of TURN credentials, s", low=60, high=604800)
    twilio_auth_token: str | None = setting(None, ACCESS, "Twilio auth token: check X-Twilio-Signature", metavar="SECRET")
    twilio_auth_token_file: str | None = setting(None, ACCESS, "file holding --twilio-auth-token", metavar="FILE")
    twilio_replay_window_s: int = setting(3600, ACCESS, "a Twilio signature is good for one stream in this long, s",
                                          low=10, high=86400)
    # Fleet: the session directory in Redis (signaling/fleet.py); off without --redis-url.
    redis_url: str | None = setting(None, FLEET, "Redis holding the fleet's session directory (none: standalone)",
                                    metavar="URL")
    advertise_url: str | None = setting(None, FLEET, "this gateway's URL as others reach it (with --redis-url)",
                                        metavar="URL")
    directory_ttl_s: float = setting(15.0, FLEET, "a directory record outlives its gateway by at most this",
                                     low=1.0, high=3600.0)
    redis_password: str | None = setting(None, FLEET, "the directory Redis's password (its requirepass)", metavar="SECRET")
    redis_password_file: str | None = setting(None, FLEET, "file holding --redis-password", metavar="FILE")
    # Tuning
    engine_parallel: int = setting(0, TUNING, "synthesis steps the worker runs at once", low=1, high=1024,
                                   zero="a core each, torch 1")
    engine_threads: int = setting(0, TUNING, "most threads one synthesis step may use", low=1, high=1024, zero="every core")
    engine_spin: str = setting("auto", TUNING, "piper: spin between ops on an idle machine",
                               choices=SPIN_POLICIES)
    engine_prior_precision: str = setting("int8", TUNING, "piper on the CPU: the prior's precision",
                                          choices=PRIOR_PRECISIONS)
    # A new stream waits while starting it would make started speech run dry (engine/runtime/scheduler.py);
    # off, every stream starts at once, as before issue 41 (bench/bench_burst.py compares the two).
    engine_hold_new: bool = setting(True, TUNING, "hold a new stream while started speech needs the cores")
    # The worker answers a ping from its scheduling loop; one silent this long is killed and restarted (engine/runtime/client.py).
    engine_ping_timeout_s: float = setting(10.0, TUNING, "restart a worker silent to a ping this long",
                                           low=0.5, high=600.0, zero="off")
    # Who builds the speech track's RTP packets (gateway/media/rtp_send.py).
    rtp_sender: str = setting("voxgate", TUNING, "who builds the speech RTP packets", choices=RTP_SENDERS)
    # How the OS schedules the event loop and the threads it waits on (gateway/media/priority.py).
    media_priority: str = setting("normal", TUNING, "realtime: SCHED_FIFO for the event loop",
                                  choices=MEDIA_PRIORITIES)
    # Threads that resample and encode speech; 0: on the event loop (gateway/media/encode_pool.py).
    encode_threads: str = setting("0", TUNING, "threads encoding speech (0: on the event loop)",
                                  choices=("auto",), low=0, high=MAX_ENCODE_THREADS, metavar="N")
    # At the latest, seconds between full garbage collections; 0: CPython's own schedule (gateway/heap.py).
    full_gc_interval_s: float = setting(300.0, TUNING, "longest time between full garbage collections",
                                        low=1.0, high=86400.0, zero="CPython's")
    # New container objects between young garbage collections; 0: CPython's default (gateway/heap.py).
    gc_young_threshold: int = setting(200, TUNING, "new objects between young garbage collections",
                                      low=YOUNG_THRESHOLD_RANGE[0], high=YOUNG_THRESHOLD_RANGE[1], zero="CPython's")
    log_level: str = setting("INFO", LOGGING, "log level, here and in the engine worker", choices=LOG_LEVELS)
    log_json: bool = setting(False, LOGGING, "one JSON object per log line")

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
    def ice_hosts(self) -> list[str]:
        """The addresses offered for media: --ice-host, else loopback on a loopback bind (only local
        clients can reach the signaling, and aioice never offers loopback itself), else every interface ([])."""
        if self.ice_host:
            return list(self.ice_host)
        if self.loopback:
            return ["::1"] if self.host == "::1" else ["127.0.0.1"]
        return []

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
        """Refuse settings out of range or that would expose the server; raises ConfigError saying what to do."""
        check_ranges(self)
        if not self.loopback and not self.api_key and not self.allow_no_auth:
            raise ConfigError(
                f"refusing to listen on {self.host} without an API key: anyone who reaches that address "
                "could create sessions, read them and use the engine. Set keys with --api-key-file FILE "
                "or VOXGATE_API_KEY (and consider --require-token), or pass --allow-no-auth to serve "
                "it open on purpose."
            )
        self._check_fleet()
        if self.turn_max_silence_ms < self.turn_min_silence_ms:
            raise ConfigError(f"--turn-max-silence-ms {self.turn_max_silence_ms}: give at least "
                              f"--turn-min-silence-ms ({self.turn_min_silence_ms})")
        if self.stt_url is not None:
            parsed = urlsplit(self.stt_url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ConfigError(f"--stt-url {self.stt_url!r} is not an http(s) URL; give the API's base, "
                                  "e.g. http://127.0.0.1:8000/v1")
            if self.stt != "none":
                raise ConfigError(f"--stt {self.stt} and --stt-url name two recognizers; give one")
        if self.relay_url is not None:
            parsed = urlsplit(self.relay_url)
            if parsed.scheme not in ("ws", "wss") or not parsed.hostname:
                raise ConfigError(f"--relay-url {self.relay_url!r} is not a ws(s):// URL; give the application's "
                                  "WebSocket, e.g. wss://app.example/relay")
        for origin in self.relay_play_origin:
            parts = urlsplit(origin.strip())
            if play_origin(origin) is None or parts.path not in ("", "/") or parts.query or parts.fragment:
                raise ConfigError(f"--relay-play-origin {origin!r} is not an origin; give a scheme and host only, "
                                  "e.g. https://cdn.example or http://127.0.0.1:8000")
        if len(self.relay_apology) > 2000:
            raise ConfigError("--relay-apology is over 2000 characters; a short sentence is what a caller needs")
        if self.engine_url is not None:
            parsed = urlsplit(self.engine_url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ConfigError(
                    f"--engine-url {self.engine_url!r} is not an http(s) URL; give the pool's Serve ingress, "
                    "e.g. http://pool:8000/"
                )
        for value in self.ice_host:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise ConfigError(f"--ice-host {value!r} is not an IP address; give one of this machine's, e.g. 127.0.0.1") from None
        for name in ("ice_allow", "trusted_proxy"):
            for value in getattr(self, name):
                if name == "ice_allow" and value == "public":
                    continue
                try:
                    ipaddress.ip_network(value, strict=False)
                except ValueError:
                    raise ConfigError(
                        f"{flag_of(name)} {value!r} is not a network; use CIDR such as 10.0.0.0/8"
                        + (" or 'public'" if name == "ice_allow" else "")
                    ) from None
        for value in self.ice_server:
            if value.partition(":")[0] not in ("stun", "turn", "turns"):
                raise ConfigError(f"--ice-server {value!r} must start with stun:, turn: or turns:")

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
        if not self.token_secret:
            raise ConfigError(
                "--redis-url needs --token-secret (VOXGATE_TOKEN_SECRET or --token-secret-file), the same on every "
                "gateway of the fleet: it signs the directory's records, so that whoever can write to Redis cannot "
                "send a session's requests elsewhere, and the client tokens any gateway must verify"
            )

    @property
    def engine_options(self) -> dict:
        """The engine constructor's keyword arguments that settings of that engine alone give."""
        if self.engine == "piper":
            return {"spin": self.engine_spin, "prior_precision": self.engine_prior_precision}
        if self.engine == "cosyvoice2":
            return {"model_dir": self.cosyvoice_model, "prompt_wav": self.cosyvoice_prompt_wav,
                    "prompt_text": self.cosyvoice_prompt_text, "speaker": self.cosyvoice_speaker}
        return {}

    @property
    def parallel(self) -> int:
        # The torch engine batches streams into one pass, so it wants one pass at
        # a time with every core; onnxruntime voices run one synthesis per core.
        if self.engine_parallel:
            return self.engine_parallel
        return 1 if self.engine == "torch" else threads_or_every_core(0)

    @property
    def threads(self) -> int:
        # The most threads one synthesis step may use. Every core: torch runs each
        # batched pass on all of them; piper uses all of them for a step that runs
        # alone and urgent (a first window) and one per step under load.
        return threads_or_every_core(self.engine_threads)


@dataclass
class PoolSettings:
    """`voxgate engine serve`: a local engine pool on Ray Serve (engine/cluster/pool.py)."""

    host: str = setting("127.0.0.1", LISTENING, "address Serve's HTTP ingress listens on (0.0.0.0 in a container)",
                        metavar="ADDR")
    port: int = setting(8000, LISTENING, "port of Serve's HTTP ingress (gateways' --engine-url)",
                        low=1, high=65535)
    direct_ingress: bool = setting(True, LISTENING, "each replica also listens itself, so gateways skip the proxy's hop")
    engine: str = setting(Settings.engine, VOICE, "speech engine each replica hosts", choices=ENGINES)
    voice: str | None = setting(Settings.voice, VOICE, "default voice of each replica", shown="the engine's own: joe for piper",
                                metavar="NAME")
    voice_dir: str | None = setting(Settings.voice_dir, VOICE, "folder of Piper .onnx voices the replicas offer by name",
                                    metavar="DIR")
    device: str = setting(Settings.device, VOICE, "where each replica's engine runs", choices=DEVICES)
    replica_cpus: float = setting(1.0, TUNING, "CPUs each replica reserves (one synthesis step per CPU)", low=0.01, high=1024.0)
    num_gpus: float = setting(0.0, TUNING, "GPU each replica reserves; a fraction shares one GPU", low=0.0, high=64.0)
    min_replicas: int = setting(1, TUNING, "replicas kept running", low=1, high=1000)
    max_replicas: int = setting(1, TUNING, "most replicas the autoscaler starts", low=1, high=1000)
    target_ongoing_requests: int = setting(16, TUNING, "streams per replica the autoscaler aims for", low=1, high=100000)
    max_ongoing_requests: int = setting(64, TUNING, "most streams one replica takes at once", low=1, high=100000)
    ray_cpus: int = setting(0, TUNING, "CPUs of the local Ray this command starts", low=1, high=4096, zero="every core")
    log_level: str = setting(Settings.log_level, LOGGING, "log level of the replicas", choices=LOG_LEVELS)

    def check(self) -> None:
        check_ranges(self)
        if not self.min_replicas <= self.max_replicas:
            raise ConfigError("need 1 <= --min-replicas <= --max-replicas")
        if not self.target_ongoing_requests <= self.max_ongoing_requests:
            raise ConfigError("need 1 <= --target-ongoing-requests <= --max-ongoing-requests")


_PREFIXES = {Settings: "VOXGATE_", PoolSettings: "VOXGATE_POOL_"}


def _env_name(name: str, prefix: str = "VOXGATE_") -> str:
    return prefix + name.upper()


def add_arguments(parser: argparse.ArgumentParser, kind: type | None = None) -> None:
    """The settings of `kind` as flags, grouped as GROUPS says, one line each."""
    kind = kind or Settings
    prefix = _PREFIXES[kind]
    parser.formatter_class = HelpFormatter
    parser.usage = "%(prog)s [flags]"
    parser.description = (
        f"Every flag --some-name is also read from the environment as {prefix}SOME_NAME (lists comma-separated); "
        f"a flag wins. Values out of range stop the command with status 2. Details: {SETTINGS_DOC}."
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    by_group = sorted(fields(kind), key=lambda f: list(GROUPS).index(f.metadata["group"]))
    for f in by_group:
        name = f.metadata["group"]
        if name not in groups:
            groups[name] = parser.add_argument_group(f"{name} ({GROUPS[name]})")
        add_flag(groups[name], f)


def settings_from(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None, kind: type | None = None):
    """Settings from flags, then VOXGATE_* variables, then defaults; raises ConfigError for a value that does not parse."""
    kind = kind or Settings
    prefix = _PREFIXES[kind]
    env_vars: Mapping[str, str] = os.environ if environ is None else environ
    settings = kind()
    for f in fields(kind):
        value = getattr(args, f.name, None) if args is not None else None
        env = _env_name(f.name, prefix)
        if value is None and env in env_vars:
            raw = env_vars[env]
            current = getattr(settings, f.name)
            try:
                value = parse_raw(raw, current)
            except ValueError as exc:
                raise ConfigError(f"{env}={raw!r}: {exc}") from None
        if value is not None:
            setattr(settings, f.name, value)
    if kind is Settings:
        read_secret_files(settings, SECRETS, listed="api_key")
    return settings
