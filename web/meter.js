// Level of the received speech, measured where the listener hears it, and a
// scrolling picture of it.

const TICK_MS = 20;
// A tick that came late (a busy tab) counts at most this long, so a stall does
// not turn into audible time that nobody heard.
const MAX_TICK_MS = 60;

export class AudioMeter {
  constructor(context) {
    this.context = context;
    this.analyser = context.createAnalyser();
    this.analyser.fftSize = 1024; // about 21 ms at 48 kHz: one tick's worth
    this.samples = new Float32Array(this.analyser.fftSize);
    // The <audio> element plays the speech; this branch only measures it. A
    // muted path to the destination keeps the graph pulled in every browser.
    const mute = context.createGain();
    mute.gain.value = 0;
    this.analyser.connect(mute).connect(context.destination);
    this.source = null;
    this.timer = null;
  }

  attach(stream) {
    if (this.source) this.source.disconnect();
    this.source = this.context.createMediaStreamSource(stream);
    this.source.connect(this.analyser);
  }

  detach() {
    if (this.source) this.source.disconnect();
    this.source = null;
  }

  // onLevel(rms, now, dtMs) every tick, rms of the last ~21 ms in 0..1.
  start(onLevel) {
    let last = performance.now();
    this.timer = setInterval(() => {
      const now = performance.now();
      const dt = Math.min(now - last, MAX_TICK_MS);
      last = now;
      this.analyser.getFloatTimeDomainData(this.samples);
      let sum = 0;
      for (const s of this.samples) sum += s * s;
      onLevel(Math.sqrt(sum / this.samples.length), now, dt);
    }, TICK_MS);
  }
}

// Scrolling bars of recent levels, on a dB scale from -60 dBFS to 0.
export class Scope {
  constructor(canvas, threshold) {
    this.canvas = canvas;
    this.threshold = threshold;
    this.levels = [];
    this.dirty = true;
    const draw = () => {
      if (this.dirty) this.draw();
      this.dirty = false;
      requestAnimationFrame(draw);
    };
    requestAnimationFrame(draw);
  }

  push(rms) {
    this.levels.push(rms);
    if (this.levels.length > 400) this.levels.splice(0, this.levels.length - 400);
    this.dirty = true;
  }

  draw() {
    const { canvas } = this;
    // Match the drawing buffer to the element's size, so bars stay crisp.
    const scale = window.devicePixelRatio || 1;
    const w = Math.round(canvas.clientWidth * scale);
    const h = Math.round(canvas.clientHeight * scale);
    if (w === 0 || h === 0) return;
    if (canvas.width !== w || canvas.height !== h) {
      canvas.width = w;
      canvas.height = h;
    }
    const ctx = canvas.getContext('2d');
    const style = getComputedStyle(canvas);
    ctx.clearRect(0, 0, w, h);
    const bar = 3 * scale;
    const count = Math.floor(w / bar);
    const recent = this.levels.slice(-count);
    const offset = count - recent.length;
    recent.forEach((rms, i) => {
      const y = heightOf(rms) * h;
      ctx.fillStyle = rms > this.threshold ? style.getPropertyValue('--accent') : style.getPropertyValue('--muted');
      ctx.fillRect((offset + i) * bar, (h - y) / 2, bar - scale, Math.max(y, scale));
    });
    // The line above which the page counts sound as audible.
    ctx.strokeStyle = style.getPropertyValue('--line');
    ctx.setLineDash([4 * scale, 4 * scale]);
    const t = ((h - heightOf(this.threshold) * h) / 2);
    ctx.beginPath();
    ctx.moveTo(0, t);
    ctx.lineTo(w, t);
    ctx.moveTo(0, h - t);
    ctx.lineTo(w, h - t);
    ctx.stroke();
    ctx.setLineDash([]);
  }
}

function heightOf(rms) {
  const db = 20 * Math.log10(Math.max(rms, 1e-6));
  return Math.min(1, Math.max(0, (db + 60) / 60));
}
