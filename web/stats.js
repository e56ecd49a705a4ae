// Receive-side figures from RTCPeerConnection.getStats(): the inbound audio
// stream, its codec, and the selected candidate pair.

export class StatsReader {
  constructor(pc) {
    this.pc = pc;
    this.previous = null; // last inbound-rtp report, for figures over the last interval
  }

  async read() {
    const report = await this.pc.getStats();
    const out = {
      codec: null, clock_rate: null, jitter_buffer_ms: null, jitter_buffer_avg_ms: null,
      jitter_ms: null, packets_lost: null, packets_received: null, rtt_ms: null,
    };
    let inbound = null;
    report.forEach((s) => {
      if (s.type === 'inbound-rtp' && (s.kind === 'audio' || s.mediaType === 'audio')) inbound = s;
      if (s.type === 'candidate-pair' && s.nominated && s.state === 'succeeded' && s.currentRoundTripTime !== undefined) {
        out.rtt_ms = s.currentRoundTripTime * 1000;
      }
    });
    if (!inbound) return out;
    const codec = inbound.codecId && report.get(inbound.codecId);
    if (codec) {
      out.codec = codec.mimeType.replace(/^audio\//, '');
      out.clock_rate = codec.clockRate;
    }
    out.jitter_ms = inbound.jitter !== undefined ? inbound.jitter * 1000 : null;
    out.packets_lost = inbound.packetsLost ?? null;
    out.packets_received = inbound.packetsReceived ?? null;
    const delay = inbound.jitterBufferDelay;
    const emitted = inbound.jitterBufferEmittedCount;
    if (emitted > 0) {
      out.jitter_buffer_avg_ms = (delay / emitted) * 1000;
      // The average since connect moves slowly; the last interval shows changes.
      const prev = this.previous;
      const dn = prev ? emitted - prev.jitterBufferEmittedCount : 0;
      out.jitter_buffer_ms = dn > 0 ? ((delay - prev.jitterBufferDelay) / dn) * 1000 : out.jitter_buffer_avg_ms;
      this.previous = { jitterBufferDelay: delay, jitterBufferEmittedCount: emitted };
    }
    return out;
  }
}
