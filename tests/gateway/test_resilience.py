"""The engine worker dies in the middle of speech: sessions get an error, keep their peer, and speak again."""

import asyncio
import os
import signal
import time


from voxgate.rtc_client import RtcClient


# Tone engine audio: 40 ms a byte, so about 2 s here.
OPEN_TEXT = "Still speaking. " * 3


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    kids.append(int(entry))
            except (OSError, IndexError):
                pass
    return kids


def engine_worker_pid(server_pid: int) -> int:
    for pid in children_of(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise AssertionError("no engine worker process found")


async def speak_again(client: RtcClient, text: str, tag: str) -> None:
    """Once the worker is back, the next utterance plays (engine_unavailable until then)."""
    for attempt in range(100):
        client.send({"type": "speak", "text": text, "id": f"{tag}-{attempt}"})
        event = await client.wait_for_any(("utterance.queued", "error"), timeout=10)
        if event["type"] == "utterance.queued":
            break
        assert event["code"] == "engine_unavailable"
        await asyncio.sleep(0.1)
    done = await client.wait_for("utterance.done", id=event["id"], timeout=20)
    assert done["text"] == text


async def test_killing_the_worker_mid_speech(server_factory):
    server = server_factory("tone")
    async with RtcClient(server.url) as a, RtcClient(server.url) as b:
        # Streamed and not yet ended, so both engine streams are open in the worker; short, so the
        # audio the sessions hold when it dies plays out in a second or two.
        a.send({"type": "text.delta", "text": OPEN_TEXT, "id": "a1"})
        b.send({"type": "text.delta", "text": OPEN_TEXT, "id": "b1"})
        await a.wait_for("audio.started", id="a1")
        await b.wait_for("audio.started", id="b1")
        os.kill(engine_worker_pid(server.proc.pid), signal.SIGKILL)
        for client in (a, b):
            error = await client.wait_for("error", timeout=10)
            assert error["code"] == "engine_crashed" and "restart" in error["message"]
        # Peers stay connected; once the worker is back, the next utterance plays.
        await speak_again(a, "Back after the crash.", "a2")
        assert a.pc.connectionState == "connected" and b.pc.connectionState == "connected"
        assert server.proc.poll() is None


async def test_a_hung_worker_is_restarted_within_its_bound(server_factory):
    """A worker frozen with its pipe open (SIGSTOP) would stall every session; the watchdog
    (--engine-ping-timeout-s) kills it as a crash: each session gets engine_crashed, and the
    other session's next utterance plays."""
    bound = 1.0
    server = server_factory("tone", extra=["--engine-ping-timeout-s", str(bound), "--log-json"])
    async with RtcClient(server.url) as a, RtcClient(server.url) as b:
        a.send({"type": "text.delta", "text": OPEN_TEXT, "id": "a1"})
        b.send({"type": "text.delta", "text": OPEN_TEXT, "id": "b1"})
        await a.wait_for("audio.started", id="a1")
        await b.wait_for("audio.started", id="b1")
        worker = engine_worker_pid(server.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        hung_at = time.monotonic()
        await server.wait_log(lambda e: "answered no ping" in e["message"], timeout=4 * bound)
        # The bound, a quarter of it between pings, and room for a loaded machine.
        assert time.monotonic() - hung_at < 3 * bound
        for client in (a, b):  # once the audio the sessions hold has played
            error = await client.wait_for("error", timeout=10)
            assert error["code"] == "engine_crashed" and "restart" in error["message"]
        await speak_again(b, "Back after the hang.", "b2")
        assert engine_worker_pid(server.proc.pid) != worker
        assert a.pc.connectionState == "connected" and b.pc.connectionState == "connected"
