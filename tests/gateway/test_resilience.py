"""The engine worker dies in the middle of speech: sessions get an error, keep their peer, and speak again."""

import asyncio
import os
import signal


from voxgate.rtc_client import RtcClient


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


async def test_killing_the_worker_mid_speech(server_factory):
    server = server_factory("tone")
    async with RtcClient(server.url) as a, RtcClient(server.url) as b:
        long = "A long utterance that is still playing when the engine worker dies. " * 6
        # Streamed and not yet ended, so both engine streams are open in the worker.
        a.send({"type": "text.delta", "text": long, "id": "a1"})
        b.send({"type": "text.delta", "text": long, "id": "b1"})
        await a.wait_for("audio.started", id="a1")
        await b.wait_for("audio.started", id="b1")
        os.kill(engine_worker_pid(server.proc.pid), signal.SIGKILL)
        for client in (a, b):
            error = await client.wait_for("error", timeout=10)
            assert error["code"] == "engine_crashed" and "restart" in error["message"]
        # Peers stay connected; once the worker is back, the next utterance plays.
        for attempt in range(100):
            a.send({"type": "speak", "text": "Back after the crash.", "id": f"a2-{attempt}"})
            event = await a.wait_for_any(("utterance.queued", "error"), timeout=10)
            if event["type"] == "utterance.queued":
                break
            assert event["code"] == "engine_unavailable"
            await asyncio.sleep(0.1)
        done = await a.wait_for("utterance.done", id=event["id"], timeout=20)
        assert done["text"] == "Back after the crash."
        assert a.pc.connectionState == "connected" and b.pc.connectionState == "connected"
        assert server.proc.poll() is None
