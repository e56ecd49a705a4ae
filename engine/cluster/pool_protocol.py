"""What crosses the hop between a gateway and the engine pool (engine/cluster/pool.py).

One HTTP request per run of text units of one stream:

    POST /v1/stream   {"options": {...}, "units": [[index, payload], ...],
                       "start_in_s": 0.0, "playing": false}

`start_in_s` is the stream's playout deadline as a duration (seconds until its
listener runs out of audio, 0: someone is waiting now), so it means the same on
the replica's clock; `playing` says whether the listener already hears this
stream (a later run of units), so that the replica does not rank it as a first
window. The response streams frames (engine/runtime/codec.py, the worker's pipe's format)
until an `end` frame:

    {"kind": "chunk", "sid", "sample_rate", "text", "words", "unit_index", "unit_end",
     "synth_s", "synth_ago_s"}                      (PCM beside it)
    {"kind": "error", "sid", "message"}            the engine refused the text
    {"kind": "end", "sid"}                          every unit was synthesized

A response that stops without `end` means the replica died mid-stream.

    GET /v1/replicas  {"replicas": [{"url": "http://IP:PORT", "id": ...}, ...]}

lists the replicas' own addresses when Serve's direct ingress is on (each
replica then listens itself, beside Serve's proxy): a gateway sends its streams
there and skips the proxy's hop. An empty list means: use the proxy. JSON, not
pickle: a pool and its gateways trust each other's shapes, never each other's code;
`check_chunk` checks every field a gateway reads from a chunk frame. This module imports neither Ray nor aiohttp: gateways and replicas both use it.
"""

from __future__ import annotations

import ipaddress
import json
import math
from dataclasses import dataclass
from urllib.parse import urlsplit


from ..runtime.codec import FrameError
from ..text.tags import MAX_BREAK_MS, MAX_RATE, MIN_RATE
from ..text.units import MAX_UNIT_CHARS

STREAM_PATH = "/v1/stream"
INFO_PATH = "/v1/info"
STATS_PATH = "/v1/stats"
REPLICAS_PATH = "/v1/replicas"
# How often a gateway reads the listing again (replicas come and go with autoscaling).
REPLICAS_REFRESH_S = 5.0
# Replicas a gateway takes from one listing; a pool larger than this is reached
# through the proxy for the rest.
MAX_REPLICAS_LISTED = 256
# Names the replica that serves a response, so a gateway counts each lost replica once.
REPLICA_HEADER = "x-voxgate-replica"

# One request: a few units. The gateway sends what is pending, up to this many.
MAX_UNITS_PER_REQUEST = 8
MAX_REQUEST_BYTES = 256 * 1024
# A speech-tag unit is a list of pieces; its text is capped like plain text.
MAX_PIECES_PER_UNIT = 64
MAX_START_IN_S = 3600.0
# What a gateway takes from a pool or a replica (its info, its chunks, its load): a
# gateway trusts no field it reads, since a pool is another machine on the network.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 48000
# A chunk's audio: a unit of MAX_UNIT_CHARS is at most ~20 s.
MAX_CHUNK_S = 60.0
# Durations a replica reports (a step, how long ago it ran, a load time): a day at most.
MAX_REPORTED_S = 86400.0
MAX_VOICES, MAX_NAME_CHARS, MAX_TAGS = 1024, 128, 64
# A replica's load: listeners it keeps speaking, and speaking now.
MAX_LISTENERS = 100_000.0


class PoolProtocolError(FrameError):
    """A request or frame that breaks the shapes or caps above."""


@dataclass
class StreamRequest:
    options: dict
    units: list[tuple[int, str | list]]
    start_in_s: float = 0.0
    playing: bool = False

    def encode(self) -> bytes:
        return json.dumps(
            {"options": self.options, "units": [[i, p] for i, p in self.units],
             "start_in_s": self.start_in_s, "playing": self.playing}
        ).encode()

    @classmethod
    def decode(cls, body: bytes) -> "StreamRequest":
        if len(body) > MAX_REQUEST_BYTES:
            raise PoolProtocolError(f"request body over {MAX_REQUEST_BYTES} bytes")
        try:
            data = json.loads(body)
        except ValueError:
            raise PoolProtocolError("request body is not JSON") from None
        if not isinstance(data, dict):
            raise PoolProtocolError("request body must be an object")
        options = data.get("options") or {}
        if not isinstance(options, dict) or not all(k in ("voice", "rate", "noise_scale", "noise_w_scale") for k in options):
            raise PoolProtocolError("options must be an object of voice, rate, noise_scale, noise_w_scale")
        units = data.get("units")
        if not isinstance(units, list) or not 1 <= len(units) <= MAX_UNITS_PER_REQUEST:
            raise PoolProtocolError(f"units must be a list of 1..{MAX_UNITS_PER_REQUEST} [index, payload]")
        checked = [_check_unit(u) for u in units]
        start_in = data.get("start_in_s", 0.0)
        if not isinstance(start_in, (int, float)) or not math.isfinite(start_in):
            raise PoolProtocolError("start_in_s must be a number")
        return cls(options, checked, min(max(0.0, float(start_in)), MAX_START_IN_S), bool(data.get("playing")))


def _check_unit(unit: object) -> tuple[int, str | list]:
    if not (isinstance(unit, list) and len(unit) == 2 and isinstance(unit[0], int) and unit[0] >= 0):
        raise PoolProtocolError("a unit is [index, payload]")
    payload = unit[1]
    if isinstance(payload, str):
        if len(payload) > MAX_UNIT_CHARS:
            raise PoolProtocolError(f"a unit's text is over {MAX_UNIT_CHARS} characters")
        return unit[0], payload
    if not isinstance(payload, list) or len(payload) > MAX_PIECES_PER_UNIT:
        raise PoolProtocolError(f"a unit's payload is text or up to {MAX_PIECES_PER_UNIT} tag pieces")
    chars = 0
    for piece in payload:
        ok = isinstance(piece, list) and (
            # The gateway's tag parser caps these (engine/text/tags.py); the pool checks again,
            # since anything on its network can call it: a NaN rate or an hour's pause
            # would cost a replica memory and time.
            (len(piece) == 3 and piece[0] == "speech" and isinstance(piece[1], str)
             and isinstance(piece[2], (int, float)) and not isinstance(piece[2], bool)
             and MIN_RATE <= piece[2] <= MAX_RATE)
            or (len(piece) == 2 and piece[0] == "pause" and isinstance(piece[1], int)
                and not isinstance(piece[1], bool) and 0 <= piece[1] <= MAX_BREAK_MS)
        )
        if not ok:
            raise PoolProtocolError(f"a tag piece is ['speech', text, rate {MIN_RATE}-{MAX_RATE}] or ['pause', ms up to {MAX_BREAK_MS}]")
        chars += len(piece[1]) if piece[0] == "speech" else 0
    if chars > MAX_UNIT_CHARS:
        raise PoolProtocolError(f"a unit's text is over {MAX_UNIT_CHARS} characters")
    return unit[0], payload


def _number(value: object, low: float, high: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise PoolProtocolError(f"{what} must be a number in {low:g}..{high:g}")
    return float(value)


def _rate(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_SAMPLE_RATE <= value <= MAX_SAMPLE_RATE:
        raise PoolProtocolError(f"sample_rate must be an integer in {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}")
    return value


def _name(value: object, limit: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit or not value.isprintable():
        raise PoolProtocolError(f"a name must be printable text of 1..{limit} characters")
    return value


@dataclass
class ChunkFields:
    unit_index: int
    sample_rate: int
    text: str
    words: list[tuple[str, float, float]]
    unit_end: bool
    synth_s: float
    synth_ago_s: float


def check_chunk(header: dict, n_pcm: int) -> ChunkFields:
    """A chunk frame's header, every field checked for type and range, and its audio's
    length against its rate: a rate of 10 made 4 MiB of PCM 58 hours of audio."""
    try:
        index = header["unit_index"]
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**31:
            raise PoolProtocolError("unit_index must be an integer in 0..2**31-1")
        rate = _rate(header["sample_rate"])
        if n_pcm / 2 / rate > MAX_CHUNK_S:
            raise PoolProtocolError(f"a chunk of over {MAX_CHUNK_S:g} s of audio")
        text = header.get("text", "")
        if not isinstance(text, str) or len(text) > 4 * MAX_UNIT_CHARS:
            raise PoolProtocolError(f"text must be a string of at most {4 * MAX_UNIT_CHARS} characters")
        words = header.get("words", [])
        if not isinstance(words, list) or len(words) > MAX_UNIT_CHARS:
            raise PoolProtocolError(f"words must be a list of at most {MAX_UNIT_CHARS}")
        checked = []
        for word in words:
            if not (isinstance(word, list) and len(word) == 3 and isinstance(word[0], str) and len(word[0]) <= MAX_UNIT_CHARS):
                raise PoolProtocolError("a word is [text, start_s, end_s]")
            start = _number(word[1], 0.0, MAX_REPORTED_S, "a word's start")
            checked.append((word[0], start, _number(word[2], start, MAX_REPORTED_S, "a word's end")))
        unit_end = header.get("unit_end", True)
        if not isinstance(unit_end, bool):
            raise PoolProtocolError("unit_end must be true or false")
        return ChunkFields(index, rate, text, checked, unit_end,
                           _number(header.get("synth_s", 0.0), 0.0, MAX_REPORTED_S, "synth_s"),
                           _number(header.get("synth_ago_s", 0.0), 0.0, MAX_REPORTED_S, "synth_ago_s"))
    except KeyError as exc:
        raise PoolProtocolError(f"a chunk frame lacks {exc.args[0]}") from None


def check_info(data: dict) -> dict:
    """A pool's /v1/info, checked: the fields gateways use, where present, in range (a
    refusal names the field); other fields kept only as short scalars (shown, never used)."""
    info: dict = {}
    for key, value in list(data.items())[:64]:
        if not isinstance(key, str) or len(key) > 64:
            continue
        if key == "sample_rate":
            info[key] = _rate(value)
        elif key == "voices":
            if not isinstance(value, list) or not 0 < len(value) <= MAX_VOICES:
                raise PoolProtocolError(f"voices must be a list of 1..{MAX_VOICES} names")
            info[key] = [_name(v) for v in value]
        elif key == "supported_tags":
            if not isinstance(value, list) or len(value) > MAX_TAGS:
                raise PoolProtocolError(f"supported_tags must be a list of at most {MAX_TAGS} names")
            info[key] = [_name(v, 32) for v in value]
        elif key == "synthesis_cost":
            # CPU seconds per audio second: a cost of 0 or NaN would make the pool's budget endless.
            info[key] = None if value is None else _number(value, 1e-4, 100.0, "synthesis_cost")
        elif key == "engine":
            info[key] = _name(value, 64)
        elif isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= 1e12):
            info[key] = value
        elif isinstance(value, str) and len(value) <= 1000 and value.isprintable():
            info[key] = value
    return info


def check_load(load: dict) -> tuple[float | None, float]:
    """A replica's load report (its /v1/stats "load"): (capacity, None while it has not
    measured; speaking), both counts of listeners in range."""
    capacity = load.get("capacity")
    if capacity is not None:
        capacity = _number(capacity, 0.0, MAX_LISTENERS, "capacity")
    return capacity, _number(load.get("speaking", 0.0), 0.0, MAX_LISTENERS, "speaking")


def replica_url(host: str, port: int, route_prefix: str = "/") -> str:
    """A replica's base URL, as the gateway joins the paths above to it."""
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}{route_prefix.rstrip('/')}"


def parse_replicas(data: object) -> list[str]:
    """The replicas' base URLs from a /v1/replicas answer: plain http URLs with a
    numeric host and port and nothing else (no credentials, query or fragment),
    at most MAX_REPLICAS_LISTED, duplicates dropped. Entries of any other shape are
    skipped: a gateway never follows a listing to a name it would resolve, or to
    another scheme."""
    if not isinstance(data, dict) or not isinstance(data.get("replicas"), list):
        raise PoolProtocolError("a replicas listing is {\"replicas\": [{\"url\": ...}, ...]}")
    urls: list[str] = []
    for entry in data["replicas"][:MAX_REPLICAS_LISTED]:
        url = entry.get("url") if isinstance(entry, dict) else None
        if not isinstance(url, str) or len(url) > 200:
            continue
        try:
            parts = urlsplit(url)
            ipaddress.ip_address(parts.hostname or "")
            port = parts.port
        except ValueError:
            continue
        if parts.scheme != "http" or port is None or parts.username or parts.password or parts.query or parts.fragment:
            continue
        if url.rstrip("/") not in urls:
            urls.append(url.rstrip("/"))
    return urls
