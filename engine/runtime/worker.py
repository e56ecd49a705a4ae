"""The engine worker process: owns the model and the device, serves many streams.

The scheduling lives in engine/runtime/scheduler.py; this module is the process around it:
it loads the engine, measures its cost, and carries the pipe (framed by engine/runtime/codec.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import cast

from ...logs import setup_logging
from . import codec
from .. import proto
from .capacity import LISTENER_MEDIA_COST, SynthesisCost, calibrate
from ..registry import create_engine
from .scheduler import Scheduler

log = logging.getLogger(__name__)

__all__ = ["Scheduler", "run_worker"]


def run_worker(
    conn, engine_name: str, engine_options: dict, parallel: int, log_level: str = "INFO", log_json: bool = False,
    hold_new: bool = True,
) -> None:
    """Entry point of the spawned process; it logs as the gateway that started it (--log-level, --log-json)."""
    setup_logging(log_level, log_json)
    send_lock = threading.Lock()

    def send(message: proto.FromWorker, pcm=None) -> None:
        data = codec.pack(message, pcm)
        with send_lock:
            conn.send_bytes(data)

    try:
        engine = create_engine(engine_name, **engine_options)
        t0 = time.perf_counter()
        engine.load()
        info = engine.info()
        info["load_s"] = time.perf_counter() - t0
        info["pid"] = os.getpid()
    except Exception as exc:
        send(proto.Fatal(f"{type(exc).__name__}: {exc}"))
        return
    try:
        t0 = time.perf_counter()
        cost = calibrate(engine, parallel)
        info["synthesis_cost"] = cost.per_audio_s
        info["calibration_s"] = time.perf_counter() - t0
    except Exception as exc:  # the engine works; its capacity is then unmeasured until its first steps
        log.warning("synthesis cost not measured at start: %s", exc)
        cost = SynthesisCost()
    scheduler = Scheduler(engine, send=send, parallel=parallel, cost=cost, media_cost=LISTENER_MEDIA_COST,
                          hold_new=hold_new)
    log.debug("worker %d: engine %s loaded in %.2f s, %d step(s) at once", info["pid"], engine_name, info["load_s"], parallel)
    send(proto.Ready(info))

    def reader() -> None:
        while True:
            try:
                record = conn.recv_bytes()
            except (EOFError, OSError):
                scheduler.inbox.put(proto.Shutdown())
                return
            message, _ = codec.unpack(record)
            scheduler.inbox.put(cast(proto.ToWorker, message))  # the gateway sends only these

    threading.Thread(target=reader, name="worker-reader", daemon=True).start()
    scheduler.serve()
    engine.close()
