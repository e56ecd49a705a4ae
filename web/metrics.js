// Per-utterance figures: what the server reports and what the page hears.
//
// The page hears one mixed stream, so it attributes sound to the utterance the
// server says is playing. Server events arrive on the data channel ahead of
// the sound they announce (the sound waits in the jitter buffer), so each
// switch takes effect one playout delay after its event.

// RMS above this (-40 dBFS) counts as audible. Decoded Opus silence is far
// below it, and speech is well above it.
export const AUDIBLE_RMS = 0.01;
// After an utterance ends, its last packets may still be in the jitter buffer.
const TAIL_MS = 120;
// Events that make a row for an utterance this page did not send.
const BACKEND_START = new Set(['utterance.queued', 'utterance.started', 'audio.started']);

export class UtteranceMetrics {
  constructor() {
    this.utterances = {};         // id -> record, in the order they were sent
    this.playing = null;          // id the sound belongs to now
    this.switches = [];           // [{at, id}] pending changes of `playing`
    this.playoutDelayMs = 60;     // refined from getStats
    this.previousEndAt = 0;       // when the last utterance's sound ended
    this.audibleTotalMs = 0;      // every audible ms since connect, attributed or not
    this.lastAudibleAt = null;
    this.onChange = () => {};
  }

  // `mode`: 'speak' or 'stream' for what this page sent, 'backend' for what another sender
  // (a backend on the session API) sent: its clock starts when the page hears of it.
  sent(id, text, mode, now) {
    this.utterances[id] = {
      id, text, mode,
      state: 'sent',
      sent_at: now,               // first text sent (performance.now() ms)
      last_delta_at: null,        // stream mode: last text.delta sent
      ended_at: null,             // speak or text.end sent
      queued_at: null,
      audio_started_at: null,     // audio.started arrived
      server_ttfa_ms: null,
      page_ttfa_ms: null,         // first audible sound minus sent_at (or the end of the one before)
      first_audible_at: null,
      last_audible_at: null,
      audible_ms: 0,              // ms with RMS over AUDIBLE_RMS while this one played
      audio_ms: null,             // from utterance.done / utterance.interrupted (played_ms)
      played_text: null,          // utterance.interrupted: the text the listener heard
      done_at: null,
      reason: null,
    };
    this.onChange(id);
  }

  get(id) {
    return this.utterances[id];
  }

  event(msg, now) {
    let u = msg.id !== undefined ? this.utterances[msg.id] : undefined;
    if (!u && BACKEND_START.has(msg.type) && typeof msg.id === 'string') {
      // Another sender's utterance, such as a backend's on a session this page joined.
      this.sent(msg.id, msg.text || '', 'backend', now);
      u = this.utterances[msg.id];
    }
    if (!u) return;
    if (!u.text && typeof msg.text === 'string') u.text = msg.text;
    switch (msg.type) {
      case 'utterance.queued':
        u.state = 'queued';
        u.queued_at = now;
        break;
      case 'utterance.started':
        if (u.state === 'queued' || u.state === 'sent') u.state = 'synthesizing';
        break;
      case 'audio.started':
        u.state = 'playing';
        u.audio_started_at = now;
        u.server_ttfa_ms = msg.ttfa_ms;
        this.schedule({ at: now + this.playoutDelayMs, id: u.id });
        break;
      case 'utterance.done':
      case 'utterance.interrupted':
        u.state = msg.type === 'utterance.done' ? 'done' : 'interrupted';
        u.audio_ms = msg.type === 'utterance.done' ? msg.audio_ms : msg.played_ms;
        if (msg.type === 'utterance.interrupted') u.played_text = msg.played_text ?? null;
        u.reason = msg.reason || null;
        u.done_at = now;
        this.schedule({ at: now + this.playoutDelayMs + TAIL_MS, id: null, from: u.id });
        break;
      case 'error':
        u.state = 'error';
        break;
      default:
        return;
    }
    this.onChange(u.id);
  }

  schedule(change) {
    let i = this.switches.length;
    while (i > 0 && this.switches[i - 1].at > change.at) i--;
    this.switches.splice(i, 0, change);
  }

  level(rms, now, dtMs) {
    while (this.switches.length && this.switches[0].at <= now) {
      const s = this.switches.shift();
      if (s.id === null) {
        // Only end what is still playing; the next one may have taken over.
        if (this.playing === s.from) {
          this.playing = null;
          this.previousEndAt = s.at;
        }
      } else {
        if (this.playing !== null) this.previousEndAt = s.at;
        this.playing = s.id;
      }
    }
    if (rms <= AUDIBLE_RMS) return;
    this.audibleTotalMs += dtMs;
    this.lastAudibleAt = now;
    const u = this.playing !== null ? this.utterances[this.playing] : undefined;
    if (!u) return;
    u.audible_ms += dtMs;
    u.last_audible_at = now;
    if (u.first_audible_at === null) {
      u.first_audible_at = now;
      u.page_ttfa_ms = now - Math.max(u.sent_at, this.previousEndAt);
      this.onChange(u.id);
    }
  }

  clear() {
    this.utterances = {};
    this.playing = null;
    this.switches = [];
    this.previousEndAt = 0;
  }
}
