// One WebRTC session with the gateway: peer connection, `control` data channel,
// received speech track, optional microphone. See docs/protocol.md.

const GATHER_TIMEOUT_MS = 5000;
const READY_TIMEOUT_MS = 15000;

// session.closed reasons that are a normal end (gateway/sessions/session.py callers), not an error.
const NORMAL_ENDS = ['ended through the session API'];

// An error whose message is meant for the person at the page.
export class PageError extends Error {}

export class GatewayConnection {
  constructor({ onEvent, onState, onTrack, onClosed }) {
    this.onEvent = onEvent;      // (msg) server event from the data channel
    this.onState = onState;      // (name, value) ice / connection / channel
    this.onTrack = onTrack;      // (MediaStream) received speech
    this.onClosed = onClosed;    // (reason) the connection ended on its own
    this.pc = null;
    this.channel = null;
    this.micStream = null;
    this.sessionId = null;
    this.closed = false;
  }

  // Resolves with the session.ready event.
  async connect({ mic = false, voice = null } = {}) {
    const iceServers = await this.fetchIceServers();
    if (mic) this.micStream = await openMicrophone();

    // No fallback to public STUN: only what the gateway says, usually nothing.
    const pc = new RTCPeerConnection({ iceServers });
    this.pc = pc;
    pc.addEventListener('iceconnectionstatechange', () => {
      this.onState('ice', pc.iceConnectionState);
      if (pc.iceConnectionState === 'failed') this.fail(iceFailedMessage());
    });
    pc.addEventListener('connectionstatechange', () => {
      this.onState('connection', pc.connectionState);
      if (pc.connectionState === 'failed') this.fail(iceFailedMessage());
    });
    pc.addEventListener('track', (e) => this.onTrack(e.streams[0] || new MediaStream([e.track])));

    // Always sendrecv, so the microphone can be turned on later without a new offer (setMic).
    const track = this.micStream ? this.micStream.getAudioTracks()[0] : 'audio';
    this.transceiver = pc.addTransceiver(track, { direction: 'sendrecv', streams: this.micStream ? [this.micStream] : [] });

    const channel = pc.createDataChannel('control');
    this.channel = channel;
    this.onState('channel', channel.readyState);
    const ready = new Promise((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new PageError('The gateway answered, but the session did not start within ' +
          `${READY_TIMEOUT_MS / 1000} s. The network path between this browser and the gateway may be blocked.`)),
        READY_TIMEOUT_MS);
      this.rejectReady = (err) => { clearTimeout(timer); reject(err); };
      channel.addEventListener('message', (e) => {
        let msg;
        try {
          msg = JSON.parse(e.data);
        } catch {
          return;
        }
        if (msg.type === 'session.ready') {
          clearTimeout(timer);
          resolve(msg);
        }
        this.onEvent(msg);
        if (msg.type === 'session.closed') {
          // A backend ending its conversation is a normal end: a line in the log, no error.
          const normal = NORMAL_ENDS.includes(msg.reason);
          this.fail(normal ? null : `The gateway closed the session: ${msg.reason}.`, `session ended: ${msg.reason}`);
        }
      });
    });
    channel.addEventListener('open', () => this.onState('channel', channel.readyState));
    channel.addEventListener('close', () => {
      this.onState('channel', channel.readyState);
      if (!this.closed) this.fail('The connection to the gateway was lost.');
    });

    await pc.setLocalDescription(withDtx(await pc.createOffer()));
    await waitForGathering(pc);
    const body = { sdp: pc.localDescription.sdp, type: 'offer' };
    if (voice) body.voice = voice;
    // A backend can hand a session it made ahead to this page: /?session_id=...&token=...
    const params = new URLSearchParams(location.search);
    if (params.get('session_id')) {
      body.session_id = params.get('session_id');
      if (params.get('token')) body.token = params.get('token');
    }
    const answer = await this.postOffer(body);
    this.sessionId = answer.session_id;
    await pc.setRemoteDescription({ type: 'answer', sdp: answer.sdp });
    return ready;
  }

  async fetchIceServers() {
    let resp;
    try {
      // TURN servers come only with a session's client token (/?session_id=...&token=...).
      const token = new URLSearchParams(location.search).get('token');
      const headers = token ? { Authorization: `Bearer ${token}` } : {};
      resp = await fetch('/v1/ice-servers', { cache: 'no-store', headers });
    } catch {
      throw new PageError(`The gateway at ${location.origin} cannot be reached. Is voxgate serve running?`);
    }
    if (!resp.ok) throw new PageError(await describeHttpError(resp, 'The gateway did not give its ICE servers'));
    const data = await resp.json();
    return data.ice_servers || [];
  }

  async postOffer(body) {
    let resp;
    try {
      resp = await fetch('/v1/offer', {
        method: 'POST',
        headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify(body),
      });
    } catch {
      throw new PageError(`The gateway at ${location.origin} cannot be reached. Is voxgate serve running?`);
    }
    if (!resp.ok) throw new PageError(await describeHttpError(resp, 'The gateway refused the connection'));
    return resp.json();
  }

  // Turn the microphone on or off on a live connection: the track on the sender changes, nothing is renegotiated.
  async setMic(on) {
    if (!this.transceiver) return;
    if (on && !this.micStream) {
      const stream = await openMicrophone();
      if (this.closed) {
        stream.getTracks().forEach((t) => t.stop());
        return;
      }
      this.micStream = stream;
      await this.transceiver.sender.replaceTrack(stream.getAudioTracks()[0]);
    } else if (!on && this.micStream) {
      await this.transceiver.sender.replaceTrack(null);
      this.micStream.getTracks().forEach((t) => t.stop());
      this.micStream = null;
    }
  }

  send(msg) {
    if (!this.channel || this.channel.readyState !== 'open') {
      throw new PageError('Not connected: press Connect first.');
    }
    this.channel.send(JSON.stringify(msg));
  }

  // The connection ended on its own; `message` is for the person (null: not an error), `reason` for the log.
  fail(message, reason = message) {
    if (this.closed) return;
    if (this.rejectReady) this.rejectReady(new PageError(message || reason));
    this.close();
    this.onClosed(message, reason);
  }

  close() {
    this.closed = true;
    if (this.channel) this.channel.close();
    if (this.pc) this.pc.close();
    if (this.micStream) this.micStream.getTracks().forEach((t) => t.stop());
    this.micStream = null;
    if (this.pc) {
      this.onState('ice', 'closed');
      this.onState('connection', 'closed');
      this.onState('channel', 'closed');
    }
  }
}

async function openMicrophone() {
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    throw new PageError('This browser cannot use a microphone here. Pages need http://localhost or https:// for that.');
  }
  try {
    return await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (err) {
    if (err.name === 'NotAllowedError' || err.name === 'SecurityError') {
      throw new PageError('Microphone permission was denied. Allow the microphone for this page, ' +
        'or untick "Microphone" to connect without it.');
    }
    if (err.name === 'NotFoundError' || err.name === 'OverconstrainedError') {
      throw new PageError('No microphone was found. Untick "Microphone" to connect without it.');
    }
    if (err.name === 'NotReadableError') {
      throw new PageError('The microphone is in use by another program or could not be opened.');
    }
    throw new PageError(`The microphone could not be opened: ${err.message || err.name}`);
  }
}

// Ask for Opus DTX (RFC 7587 usedtx=1): this browser's decoder fills gaps, so
// between utterances the gateway sends a keep-alive every 400 ms instead of
// silence every 20 ms, which is most of a listener's cost to it while the bot
// is quiet.
function withDtx(offer) {
  const opus = /^a=rtpmap:(\d+) opus\/48000[^\r\n]*(\r?\n)/im.exec(offer.sdp);
  if (!opus) return offer;
  const [rtpmap, pt, eol] = opus;
  const fmtp = new RegExp(`^a=fmtp:${pt} [^\r\n]*`, 'm');
  const line = fmtp.exec(offer.sdp);
  if (line && /usedtx=/.test(line[0])) return offer;
  const sdp = line ? offer.sdp.replace(fmtp, `${line[0]};usedtx=1`)
    : offer.sdp.replace(rtpmap, `${rtpmap}a=fmtp:${pt} usedtx=1${eol}`);
  return { type: offer.type, sdp };
}

// The gateway does not take trickled candidates from us during the offer, so
// the offer carries them all.
function waitForGathering(pc) {
  if (pc.iceGatheringState === 'complete') return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (pc.iceGatheringState !== 'complete') return;
      pc.removeEventListener('icegatheringstatechange', done);
      clearTimeout(timer);
      resolve();
    };
    // Some networks never finish gathering; the candidates found so far will do.
    const timer = setTimeout(resolve, GATHER_TIMEOUT_MS);
    pc.addEventListener('icegatheringstatechange', done);
  });
}

async function describeHttpError(resp, what) {
  let detail = `HTTP ${resp.status}`;
  try {
    const data = await resp.json();
    if (data.error) detail = `${data.error.message} (${data.error.code})`;
  } catch {
    // not JSON: a proxy in the way, probably
  }
  return `${what}: ${detail}`;
}

function iceFailedMessage() {
  return 'ICE failed: the browser found no network path to the gateway. The gateway only accepts ' +
    'addresses from its allowed networks (--ice-host, --ice-allow); across NAT it needs a TURN server (--ice-server).';
}
