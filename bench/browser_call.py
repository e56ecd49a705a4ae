"""One call from a real chromium to a gateway, measured in the browser: what it played and what it reports.

The page script (CALL_JS) opens its own RTCPeerConnection (receive-only audio
and a `control` data channel) from a page on the gateway's origin, so it can
choose its ICE servers and `iceTransportPolicy` (TURN-only calls), and it
records what chromium actually played: the remote track goes through an
AudioWorklet that copies every render quantum, after chromium's jitter buffer
and loss concealment (NetEq). `getStats` gives the inbound RTP figures
(packets lost, concealed samples, jitter buffer delay and target, FEC).

`launch` starts Debian's chromium with the flags the tests use; `call` runs one
session, optionally through a `netem.RelayThread`.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from dataclasses import dataclass, field

import numpy as np

CHROMIUM = "/usr/bin/chromium"
RATE = 48000  # the AudioContext's rate: what the recording holds
CHROMIUM_ARGS = [
    "--allow-loopback-in-peer-connection",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    # Host candidates as addresses, not mDNS names: the relay rewrites the browser's 127.0.0.1 candidate.
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--disable-background-networking",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]

# Runs in the page. Resolves once session.ready has come, with the offer's SDP.
CALL_JS = r"""
async ({iceServers, policy, readyMs, offerExtra}) => {
  const vg = {events: [], chunks: [], chunkAt: [], t0: performance.now(), firstAudibleAt: null};
  window.vg = vg;
  const worklet = `registerProcessor('rec', class extends AudioWorkletProcessor {
    constructor() { super(); this.buf = new Float32Array(4800); this.n = 0; }
    process(inputs) {
      const ch = inputs[0] && inputs[0][0];
      if (ch) {
        this.buf.set(ch, this.n); this.n += ch.length;
        if (this.n >= 4800 - 128) { this.port.postMessage(this.buf.slice(0, this.n)); this.n = 0; }
      }
      return true;
    }
  });`;
  const ctx = new AudioContext({sampleRate: 48000});
  await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([worklet], {type: 'application/javascript'})));
  await ctx.resume();
  const pc = new RTCPeerConnection({iceServers, iceTransportPolicy: policy});
  vg.pc = pc;
  pc.addTransceiver('audio', {direction: 'recvonly'});
  pc.addEventListener('track', (e) => {
    const stream = e.streams[0] || new MediaStream([e.track]);
    // Chromium feeds a remote stream to WebAudio only while a media element plays it.
    const el = new Audio(); el.muted = true; el.srcObject = stream; el.play(); vg.el = el;
    const node = new AudioWorkletNode(ctx, 'rec');
    node.port.onmessage = (m) => {
      vg.chunks.push(m.data);
      vg.chunkAt.push(performance.now());
      if (vg.firstAudibleAt === null && m.data.some((x) => Math.abs(x) > 0.01)) vg.firstAudibleAt = performance.now();
    };
    ctx.createMediaStreamSource(stream).connect(node);
    node.connect(ctx.destination);
  });
  const dc = pc.createDataChannel('control');
  vg.dc = dc;
  const ready = new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('no session.ready')), readyMs);
    dc.onmessage = (e) => {
      const msg = JSON.parse(e.data);
      vg.events.push({t: performance.now(), msg});
      if (msg.type === 'session.ready') { clearTimeout(timer); resolve(msg); }
    };
  });
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((resolve) => {
    if (pc.iceGatheringState === 'complete') return resolve();
    pc.addEventListener('icegatheringstatechange', () => pc.iceGatheringState === 'complete' && resolve());
    setTimeout(resolve, 3000);
  });
  const offer = pc.localDescription.sdp;
  vg.offerSentAt = performance.now();
  const resp = await fetch('/v1/offer', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                         body: JSON.stringify({sdp: offer, type: 'offer', ...offerExtra})});
  if (!resp.ok) throw new Error('offer refused: ' + resp.status + ' ' + await resp.text());
  const answer = await resp.json();
  vg.offeredAt = performance.now();
  await pc.setRemoteDescription({type: 'answer', sdp: answer.sdp});
  await ready;
  vg.readyAt = performance.now();
  return offer;
}
"""

STATS_JS = r"""
async () => {
  const out = {};
  for (const s of (await window.vg.pc.getStats()).values()) {
    if (s.type === 'inbound-rtp' && s.kind === 'audio') out.inbound = s;
    if (s.type === 'candidate-pair' && s.nominated && s.state === 'succeeded') out.pair = s;
    if (s.type === 'local-candidate') (out.local = out.local || {})[s.id] = s;
    if (s.type === 'remote-candidate') (out.remote = out.remote || {})[s.id] = s;
  }
  if (out.pair) {
    out.localCandidate = out.local[out.pair.localCandidateId];
    out.remoteCandidate = out.remote[out.pair.remoteCandidateId];
  }
  delete out.local; delete out.remote;
  return JSON.parse(JSON.stringify(out));
}
"""

# The recording since `from` (index into chunks), as base64 little-endian int16.
RECORDING_JS = r"""
(from) => {
  const chunks = window.vg.chunks.slice(from);
  const n = chunks.reduce((a, c) => a + c.length, 0);
  const pcm = new Int16Array(n);
  let i = 0;
  for (const c of chunks) for (const x of c) pcm[i++] = Math.max(-32768, Math.min(32767, Math.round(x * 32767)));
  const bytes = new Uint8Array(pcm.buffer);
  let s = '';
  for (let j = 0; j < bytes.length; j += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(j, j + 0x8000));
  return btoa(s);
}
"""

INBOUND_FIELDS = (
    "packetsReceived", "packetsLost", "packetsDiscarded", "fecPacketsReceived", "fecPacketsDiscarded",
    "concealedSamples", "silentConcealedSamples", "concealmentEvents", "insertedSamplesForDeceleration",
    "removedSamplesForAcceleration", "totalSamplesReceived", "jitterBufferDelay", "jitterBufferTargetDelay",
    "jitterBufferMinimumDelay", "jitterBufferEmittedCount", "jitter",
)


def launch(playwright, extra_args: list[str] | None = None):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS + (extra_args or []))


@dataclass
class CallResult:
    """What one utterance did in the browser."""

    stats: dict  # the inbound-rtp figures over the utterance (differences of INBOUND_FIELDS)
    pcm: np.ndarray  # int16 at RATE: what chromium played from `speak` until the utterance's tail drained
    events: list[dict] = field(default_factory=list)
    pair: dict = field(default_factory=dict)  # the selected candidate pair's local and remote candidates
    first_audio_ms: float | None = None  # from sending `speak` to the first audible sample the page played
    ready_ms: float = 0.0  # from the answer's arrival to session.ready (ICE, DTLS, SCTP)
    # The first utterance only: from sending the offer to the first audible sample (`speak` sent at session.ready).
    connect_to_audio_ms: float | None = None
    totals: dict = field(default_factory=dict)  # the inbound-rtp figures since the session began
    relay_lost: int | None = None  # packets the relay had dropped when `totals` were read

    @property
    def concealed_share(self) -> float:
        """Concealed samples that were not silence, per sample received."""
        s = self.stats
        total = s.get("totalSamplesReceived", 0)
        return (s.get("concealedSamples", 0) - s.get("silentConcealedSamples", 0)) / total if total else float("nan")

    @property
    def jitter_buffer_ms(self) -> float:
        n = self.stats.get("jitterBufferEmittedCount", 0)
        return 1000.0 * self.stats.get("jitterBufferDelay", 0.0) / n if n else float("nan")

    @property
    def jitter_buffer_target_ms(self) -> float:
        n = self.stats.get("jitterBufferEmittedCount", 0)
        return 1000.0 * self.stats.get("jitterBufferTargetDelay", 0.0) / n if n else float("nan")


def turn_servers(url: str, transport: str | None = None) -> tuple[dict, list[dict]]:
    """A session made ahead ({"session_id", "token"}) and the TURN servers the gateway hands its
    client token (`GET /v1/ice-servers`: credentials minted with --turn-secret), only those over
    `transport` ("udp", "tcp" or "tls") when given."""
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/sessions", data=b"{}", method="POST",
                                                       headers={"Content-Type": "application/json"}), timeout=10) as r:
        made = json.load(r)
    session = {"session_id": made["session_id"], "token": made["client_token"]}
    with urllib.request.urlopen(url + "/v1/ice-servers?token=" + session["token"], timeout=10) as r:
        servers = json.load(r)["ice_servers"]
    if transport is not None:
        def over(u: str) -> bool:
            return u.startswith("turns:") if transport == "tls" else u.startswith("turn:") and u.endswith("transport=" + transport)
        servers = [{**s, "urls": [u for u in s["urls"] if over(u)]} for s in servers]
        servers = [s for s in servers if s["urls"]]
    return session, servers


def _inbound(page) -> dict:
    got = page.evaluate(STATS_JS)
    inbound = got.get("inbound", {})
    return {k: inbound.get(k, 0) for k in INBOUND_FIELDS}


def _wait_event(page, kind: str, uid: str | None, timeout_ms: float) -> dict:
    handle = page.wait_for_function(
        "([kind, uid]) => window.vg.events.find((e) => e.msg.type === kind && (uid === null || e.msg.id === uid))",
        arg=[kind, uid], timeout=timeout_ms,
    )
    return handle.json_value()


def open_session(context, url: str, relay=None, ice_servers: list[dict] | None = None, policy: str = "all",
                 timeout_ms: float = 30000, made_ahead: dict | None = None):
    """A page in `context` with a ready session (CALL_JS), through `relay` when given."""
    page = context.new_page()
    if relay is not None:
        def route(r, request) -> None:
            body = request.post_data_json
            body["sdp"] = relay.rewrite_offer(body["sdp"])
            resp = r.fetch(post_data=json.dumps(body))
            data = resp.json()
            if resp.ok:
                data["sdp"] = relay.rewrite_answer(data["sdp"])
            r.fulfill(response=resp, json=data)

        page.route("**/v1/offer", route)
    page.goto(url + "/healthz")
    page.evaluate(CALL_JS, {"iceServers": ice_servers or [], "policy": policy, "readyMs": timeout_ms,
                            "offerExtra": made_ahead or {}})
    return page


def call(browser, url: str, texts: list[str], relay=None, ice_servers: list[dict] | None = None,
         policy: str = "all", tail_ms: int = 600, timeout_ms: float = 30000,
         made_ahead: dict | None = None) -> list[CallResult]:
    """One session: each text spoken in turn and measured on its own; `relay` (a netem.RelayThread)
    sits in the media path when given; `made_ahead` ({"session_id", "token"}) joins a session made
    through the session API (the way a page gets TURN credentials: `turn_servers`)."""
    # The gateway's CSP forbids the blob: worklet this page script records with.
    context = browser.new_context(bypass_csp=True)
    try:
        page = open_session(context, url, relay, ice_servers, policy, timeout_ms, made_ahead)
        results = []
        for i, text in enumerate(texts):
            uid = f"n{i}"
            chunk0 = page.evaluate("window.vg.chunks.length")
            before = _inbound(page)
            page.evaluate("([id, text]) => { const vg = window.vg; vg.firstAudibleAt = null; vg.spokeAt = performance.now(); "
                          "vg.dc.send(JSON.stringify({type: 'speak', id, text})); }", [uid, text])
            _wait_event(page, "utterance.done", uid, timeout_ms)
            # The tail still in the jitter buffer; the recording catches up by then too.
            page.wait_for_timeout(tail_ms)
            after = _inbound(page)
            relay_lost = None if relay is None else relay.relay.stats.rtp_lost + relay.relay.stats.rtp_capped
            got = page.evaluate(STATS_JS)
            pcm = np.frombuffer(base64.b64decode(page.evaluate(RECORDING_JS, chunk0)), dtype=np.int16).copy()
            vg = page.evaluate("({events: window.vg.events.map((e) => e.msg), first: window.vg.firstAudibleAt, "
                               "spoke: window.vg.spokeAt, offered: window.vg.offeredAt, ready: window.vg.readyAt, "
                               "sent: window.vg.offerSentAt})")
            results.append(CallResult(
                stats={k: after[k] - before[k] for k in INBOUND_FIELDS},
                pcm=pcm,
                events=vg["events"],
                pair={"local": got.get("localCandidate", {}), "remote": got.get("remoteCandidate", {})},
                first_audio_ms=(vg["first"] - vg["spoke"]) if vg["first"] is not None else None,
                ready_ms=vg["ready"] - vg["offered"],
                connect_to_audio_ms=(vg["first"] - vg["sent"]) if i == 0 and vg["first"] is not None else None,
                totals=after,
                relay_lost=relay_lost,
            ))
        return results
    finally:
        context.close()
