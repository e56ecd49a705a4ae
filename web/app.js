// The Voxgate page: connect, speak, stream, stop, barge in, and watch the figures.
//
// Automation reads `window.voxgate`: `state` (connection and session),
// `metrics.utterances` (per utterance, see metrics.js), `metrics.audibleTotalMs`,
// `stats` (getStats figures) and `events` ({t, dir, msg}; t is performance.now()
// ms, dir 'in', 'out' or 'page').

import { GatewayConnection, PageError } from './connection.js';
import { AudioMeter, Scope } from './meter.js';
import { AUDIBLE_RMS, UtteranceMetrics } from './metrics.js';
import { StatsReader } from './stats.js';

const $ = (id) => document.getElementById(id);
const LOG_LIMIT = 400;
const STATS_MS = 500;
const RECENT = 5; // utterances whose TTFA the figures list

const state = {
  ice: 'new', connection: 'new', channel: 'closed', session: 'none',
  session_id: null, codec: null, voice: null, voices: [], rate: 1, vad_enabled: true,
  mic: false, speech: false, streams: 0,
};
const metrics = new UtteranceMetrics();
const events = [];
const stats = {};
// Live captions from audio.words: each word shows when its audio plays here.
const captions = { id: null, words: [], shown: 0, starts: {} };
window.voxgate = { state, metrics, events, stats, captions, AUDIBLE_RMS };

let conn = null;
let audioContext = null;
let meter = null;
let statsTimer = null;
let nextId = 1;
let chosenVoice = null;
const streams = new Map(); // id -> running word-by-word feeder; Stop and barge-in abort them
const scope = new Scope($('scope'), AUDIBLE_RMS);

// Connection

async function connect() {
  hideError();
  // Audio must start inside the click, or the browser keeps it suspended.
  if (!audioContext) {
    audioContext = new AudioContext();
    meter = new AudioMeter(audioContext);
    meter.start(onLevel);
  }
  audioContext.resume();
  $('player').play().catch(() => {});

  metrics.clear();
  renderQueue();
  state.mic = $('mic').checked;
  setState('session', 'connecting');
  const c = new GatewayConnection({ onEvent, onState: setState, onTrack, onClosed });
  conn = c;
  updateControls();
  try {
    await c.connect({ mic: state.mic, voice: chosenVoice });
  } catch (err) {
    if (conn !== c) return; // disconnected meanwhile
    c.close();
    conn = null;
    setState('session', 'failed');
    showError(err);
    updateControls();
    return;
  }
  const reader = new StatsReader(c.pc);
  statsTimer = setInterval(() => readStats(c, reader), STATS_MS);
}

function disconnect() {
  stopStreams();
  if (conn) conn.close();
  conn = null;
  afterClose();
  setState('session', 'closed');
  note('disconnected');
}

function afterClose() {
  clearInterval(statsTimer);
  statsTimer = null;
  if (meter) meter.detach();
  $('player').srcObject = null;
  setSpeech(false);
  updateControls();
}

function onClosed(message, reason) {
  conn = null;
  stopStreams();
  afterClose();
  setState('session', 'closed');
  // One line in the log: the error (which logs itself), or the reason of a normal end.
  if (message) showError(message);
  else note(reason);
}

function onTrack(stream) {
  const player = $('player');
  player.srcObject = stream;
  player.play().catch(() => {});
  meter.attach(stream);
}

function setState(name, value) {
  state[name] = value;
  const el = $(`state-${name}`);
  if (el) {
    el.textContent = value;
    el.dataset.state = value;
  }
}

// Server events

function onEvent(msg) {
  const now = performance.now();
  record('in', msg, now);
  metrics.event(msg, now);
  switch (msg.type) {
    case 'session.ready':
      state.session_id = msg.session_id;
      state.codec = msg.codec;
      state.voices = msg.voices || [];
      setState('session', 'ready');
      fillVoices(state.voices, msg.voice);
      $('fig-codec').textContent = describeCodec(msg.codec, msg.sample_rate);
      // A choice made before connecting applies to this session too.
      send({ type: 'session.update', rate: Number($('rate').value), vad: { enabled: $('vad').checked } });
      updateControls();
      break;
    case 'session.updated':
      state.voice = msg.voice;
      state.rate = msg.rate;
      state.vad_enabled = msg.vad ? msg.vad.enabled : state.vad_enabled;
      if (msg.voice) $('voice').value = msg.voice;
      $('vad').checked = state.vad_enabled;
      break;
    case 'utterance.interrupted':
      // The server refuses more text for an interrupted utterance; stop feeding it.
      if (streams.has(msg.id)) {
        streams.get(msg.id).aborted = true;
        streams.delete(msg.id);
        state.streams = streams.size;
      }
      break;
    case 'audio.started':
      // Where the utterance's first frame lies on the session clock, and on this page's:
      // it plays once it has waited in the jitter buffer.
      captions.starts[msg.id] = { at_ms: msg.at_ms, local: now + (stats.jitter_buffer_ms || 0) };
      break;
    case 'audio.words':
      showWords(msg, now);
      break;
    case 'speech.started':
      setSpeech(true);
      break;
    case 'speech.stopped':
      setSpeech(false);
      break;
    case 'error':
      showError(`The gateway refused a message: ${msg.message} (${msg.code})`);
      break;
    default:
      break;
  }
}

function showWords(msg, now) {
  const start = captions.starts[msg.id];
  if (!start) return;
  const el = $('captions');
  if (captions.id !== msg.id) {
    captions.id = msg.id;
    captions.words = [];
    captions.shown = 0;
    el.replaceChildren();
  }
  for (const w of msg.words) {
    const span = document.createElement('span');
    span.className = 'word';
    span.textContent = `${w.word} `;
    el.append(span);
    captions.words.push(w.word);
    const due = start.local + (w.start_ms - start.at_ms) - now;
    setTimeout(() => {
      if (captions.id !== msg.id) return;
      for (const prev of el.querySelectorAll('.word.current')) prev.classList.remove('current');
      span.classList.add('heard', 'current');
      captions.shown += 1;
    }, Math.max(0, due));
  }
}

function setSpeech(active) {
  state.speech = active;
  const el = $('vad-indicator');
  el.dataset.active = String(active);
  el.textContent = active ? 'speech' : 'silent';
}

function fillVoices(voices, current) {
  const select = $('voice');
  select.replaceChildren(...voices.map((v) => new Option(v, v)));
  select.value = current;
  state.voice = current;
}

function describeCodec(codec, rate) {
  if (!codec) return 'none (no audio)';
  return `${codec === 'opus' ? 'Opus' : codec.toUpperCase()} ${rate / 1000} kHz`;
}

// Sending

function send(msg) {
  if (!conn) throw new PageError('Not connected: press Connect first.');
  conn.send(msg);
  record('out', msg, performance.now());
}

function speak() {
  hideError();
  const text = $('text').value.trim();
  if (!text) {
    showError('Type some text first.');
    return;
  }
  const id = `p${nextId++}`;
  try {
    if ($('mode-stream').checked) {
      streamText(id, text, Number($('token-rate').value) || 8);
    } else {
      const now = performance.now();
      metrics.sent(id, text, 'speak', now);
      send({ type: 'speak', id, text });
      metrics.get(id).ended_at = now;
    }
  } catch (err) {
    showError(err);
  }
  renderQueue();
}

// Feeds the text word by word at `rate` tokens/s, the way an LLM streams.
function streamText(id, text, rate) {
  const words = text.match(/\S+\s*/g) || [];
  const feeder = { aborted: false };
  streams.set(id, feeder);
  state.streams = streams.size;
  const interval = 1000 / Math.max(0.5, Math.min(rate, 100));
  const start = performance.now();
  let i = 0;
  const step = () => {
    if (feeder.aborted || !conn) {
      finish();
      return;
    }
    try {
      const now = performance.now();
      if (i < words.length) {
        if (i === 0) metrics.sent(id, text, 'stream', now);
        send({ type: 'text.delta', id, text: words[i] });
        metrics.get(id).last_delta_at = performance.now();
        i += 1;
        // Timed from the start, so slow ticks do not slow the whole stream.
        setTimeout(step, Math.max(0, start + i * interval - performance.now()));
        return;
      }
      send({ type: 'text.end', id });
      metrics.get(id).ended_at = performance.now();
    } catch (err) {
      showError(err);
    }
    finish();
  };
  const finish = () => {
    if (streams.get(id) === feeder) streams.delete(id);
    state.streams = streams.size;
  };
  step();
}

function stopStreams() {
  for (const feeder of streams.values()) feeder.aborted = true;
  streams.clear();
  state.streams = 0;
}

function stop() {
  stopStreams();
  try {
    send({ type: 'cancel' });
  } catch (err) {
    showError(err);
  }
}

function update(fields) {
  try {
    send({ type: 'session.update', ...fields });
  } catch (err) {
    showError(err);
  }
}

// Audio level and stats

function onLevel(rms, now, dt) {
  metrics.level(rms, now, dt);
  scope.push(rms);
}

async function readStats(c, reader) {
  if (c !== conn) return;
  let figures;
  try {
    figures = await reader.read();
  } catch {
    return; // the connection closed under us
  }
  Object.assign(stats, figures);
  if (figures.jitter_buffer_ms > 0) metrics.playoutDelayMs = figures.jitter_buffer_ms;
  if (figures.codec) $('fig-codec').textContent = describeCodec(figures.codec.toLowerCase(), figures.clock_rate);
  $('fig-jitter-buffer').textContent = ms(figures.jitter_buffer_ms);
  $('fig-jitter').textContent = ms(figures.jitter_ms);
  $('fig-lost').textContent = figures.packets_lost === null ? '–'
    : `${figures.packets_lost} of ${figures.packets_received + figures.packets_lost}`;
  $('fig-rtt').textContent = ms(figures.rtt_ms);
}

function ms(value) {
  return value === null || value === undefined ? '–' : `${value.toFixed(value < 10 ? 1 : 0)} ms`;
}

// The queue table

const rows = new Map();

function renderQueue() {
  const body = $('queue').tBodies[0];
  const all = Object.values(metrics.utterances);
  if (all.length === 0) {
    body.replaceChildren();
    rows.clear();
  }
  let latest = null;
  for (const u of all) {
    let row = rows.get(u.id);
    if (!row) {
      row = body.insertRow(0);
      row.id = `utt-${u.id}`;
      for (let i = 0; i < 6; i++) row.insertCell();
      row.cells[0].textContent = u.id;
      rows.set(u.id, row);
    }
    showText(row.cells[5], u);
    row.dataset.state = u.state;
    row.cells[1].textContent = u.state + (u.reason ? ` (${u.reason})` : '');
    row.cells[2].textContent = ms(u.server_ttfa_ms);
    row.cells[3].textContent = ms(u.page_ttfa_ms);
    // Audible time as the page heard it, against the audio the server sent.
    row.cells[4].textContent = u.audio_ms === null ? ms(u.audible_ms)
      : `${u.audible_ms.toFixed(0)} / ${ms(u.audio_ms)}`;
    if (u.server_ttfa_ms !== null) latest = u;
  }
  if (latest) {
    $('fig-server-ttfa').textContent = `${ms(latest.server_ttfa_ms)} (${latest.id})`;
    $('fig-page-ttfa').textContent = latest.page_ttfa_ms === null ? 'listening…'
      : `${ms(latest.page_ttfa_ms)} (${latest.id})`;
  }
  const server = all.map((u) => u.server_ttfa_ms).filter((v) => v !== null);
  const page = all.map((u) => u.page_ttfa_ms).filter((v) => v !== null);
  $('fig-ttfa-p50').textContent = server.length === 0 ? '–'
    : `${ms(median(server))} / ${ms(median(page))} (${server.length})`;
  $('fig-ttfa-recent').textContent = server.length === 0 ? '–'
    : server.slice(-RECENT).map((v) => v.toFixed(0)).join(' · ') + ' ms';
}

function median(values) {
  if (values.length === 0) return null;
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

// The text, and after an interruption what the listener heard of it (played_text) apart from the rest.
function showText(cell, u) {
  const key = `${u.text}\u0000${u.played_text}`;
  if (cell.dataset.key === key) return;
  cell.dataset.key = key;
  cell.title = u.played_text === null ? u.text : `heard: ${u.played_text}`;
  if (u.played_text === null) {
    cell.textContent = u.text;
    return;
  }
  const heard = document.createElement('span');
  heard.className = 'heard';
  heard.textContent = u.played_text;
  const rest = document.createElement('s');
  rest.className = 'unheard';
  rest.textContent = u.text.startsWith(u.played_text) ? u.text.slice(u.played_text.length) : '';
  cell.replaceChildren(heard, rest);
}

metrics.onChange = () => renderQueue();
setInterval(() => {
  if (metrics.playing !== null) renderQueue();
}, 250);

// The log and errors

function record(dir, msg, t) {
  events.push({ t, dir, msg });
  if (events.length > 5000) events.splice(0, events.length - 5000);
  const li = document.createElement('li');
  li.className = dir;
  const time = document.createElement('time');
  time.textContent = (t / 1000).toFixed(3);
  const arrow = { in: '←', out: '→', page: '•' }[dir];
  li.append(time, ` ${arrow} `);
  const type = document.createElement('b');
  type.textContent = msg.type;
  const { type: _, ...rest } = msg;
  const detail = Object.keys(rest).length ? ` ${JSON.stringify(rest)}` : '';
  li.append(type, detail);
  const log = $('log');
  const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.append(li);
  while (log.childElementCount > LOG_LIMIT) log.firstElementChild.remove();
  if (atBottom) log.scrollTop = log.scrollHeight;
}

function note(text) {
  record('page', { type: text }, performance.now());
}

function showError(err) {
  let text;
  if (typeof err === 'string') text = err;
  else if (err instanceof PageError) text = err.message;
  else text = `Something went wrong: ${err && err.message ? err.message : err}`;
  $('error-text').textContent = text;
  $('error').hidden = false;
  note(`error: ${text}`);
}

function hideError() {
  $('error').hidden = true;
}

// Controls

function updateControls() {
  const connected = conn !== null;
  const ready = connected && state.session === 'ready';
  $('connect').disabled = connected;
  $('disconnect').disabled = !connected;
  for (const id of ['speak', 'stop', 'voice', 'rate', 'vad']) $(id).disabled = !ready;
}

$('connect').addEventListener('click', connect);
$('disconnect').addEventListener('click', disconnect);
$('speak').addEventListener('click', speak);
$('stop').addEventListener('click', stop);
$('text').addEventListener('keydown', (e) => {
  // Ctrl+Enter speaks, so the keyboard alone is enough.
  if (e.key === 'Enter' && (e.ctrlKey || e.metaKey) && !$('speak').disabled) speak();
});
$('voice').addEventListener('change', () => {
  chosenVoice = $('voice').value;
  update({ voice: chosenVoice });
});
$('rate').addEventListener('input', () => {
  $('rate-value').textContent = `${Number($('rate').value).toFixed(2)}×`;
});
$('rate').addEventListener('change', () => update({ rate: Number($('rate').value) }));
$('vad').addEventListener('change', () => update({ vad: { enabled: $('vad').checked } }));
$('mic').addEventListener('change', async () => {
  state.mic = $('mic').checked;
  if (!conn) return; // applies when connecting
  try {
    await conn.setMic(state.mic);
    note(state.mic ? 'microphone on' : 'microphone off');
  } catch (err) {
    $('mic').checked = state.mic = false;
    showError(err);
  }
});
$('error-close').addEventListener('click', hideError);
// A tab closing ends its connection at once (the gateway sees the DTLS close), instead of
// the gateway waiting half a minute for ICE consent to fail.
window.addEventListener('pagehide', () => {
  if (conn) conn.close();
});
$('log-clear').addEventListener('click', () => $('log').replaceChildren());
updateControls();
