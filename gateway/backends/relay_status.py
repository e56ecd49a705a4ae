"""A relayed conversation's end, POSTed to its status callback: the relay option `action` (Twilio's
`<Connect action>`, where the vendor posts a ConversationRelay session's outcome and handoffData;
`statusCallback` names it too). docs/relay.md lists the form's fields.

The request is one the application's URL chose, so it goes through the outbound guard
(gateway/backends/outbound.py) as the relay's WebSocket does: loopback and private addresses only with
--relay-allow-private. It is bounded: --relay-connect-timeout-s per try, one retry a second later
for a connection that failed or a 5xx, no redirects, the answer's body unread. It runs on its own
task, so it never holds up the session's close; a callback that fails is logged once. At most
MAX_PENDING run at once in the process; past that a callback is dropped, and logged.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp

from .outbound import PrivateAddress, guarded_http, private_refusal, refuse_private_host, shown_url

if TYPE_CHECKING:
    from ...config import Settings

log = logging.getLogger(__name__)

MAX_PENDING = 64
RETRY_AFTER_S = 1.0
API_VERSION = "2010-04-01"  # the version Twilio's callbacks carry; applications that read it find it
_pending: set[asyncio.Task] = set()


def form_signature(auth_token: str, url: str, form: dict[str, str]) -> str:
    """X-Twilio-Signature for a form POST: base64(HMAC-SHA1(token, URL + each name and value, by name))."""
    data = url + "".join(name + form[name] for name in sorted(form))
    return base64.b64encode(hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()).decode("ascii")


def status_form(*, session_id: str, call_sid: str, from_: str, to: str, status: str, started: float,
                handoff: str | None, error: str | None, reason: str) -> dict[str, str]:
    """The form Twilio posts to `<Connect action>` when a ConversationRelay session ends, as Voxgate fills it.
    `status`: `ended` (the application's `end`), `completed` (the caller or the session ended it),
    `failed` (the application failed)."""
    form = {
        "AccountSid": "",
        "CallSid": call_sid or session_id,
        "CallStatus": "completed",
        "From": from_,
        "To": to,
        "Direction": "inbound",
        "ApiVersion": API_VERSION,
        "SessionId": session_id,
        "SessionStatus": status,
        "SessionDuration": str(max(0, round(time.monotonic() - started))),
        "VoxgateCloseReason": reason[:200],
    }
    if handoff is not None:
        form["HandoffData"] = handoff
    if error is not None:
        form["ErrorMessage"] = error[:500]
    return form


def post_status(url: str, form: dict[str, str], settings: Settings, auth_token: str | None, session_id: str) -> None:
    """POST `form` to `url` on a task of its own; returns at once."""
    if len(_pending) >= MAX_PENDING:
        log.warning("session %s: status callback to %s dropped: %d callbacks are being sent", session_id,
                    shown_url(url), MAX_PENDING, extra={"session_id": session_id})
        return
    task = asyncio.ensure_future(_post(url, form, settings, auth_token, session_id))
    _pending.add(task)
    task.add_done_callback(_pending.discard)


async def _post(url: str, form: dict[str, str], settings: Settings, auth_token: str | None, session_id: str) -> None:
    headers = {"X-Twilio-Signature": form_signature(auth_token, url, form)} if auth_token else {}
    why = ""
    for attempt in range(2):
        if attempt:
            await asyncio.sleep(RETRY_AFTER_S)
        try:
            refuse_private_host(urlsplit(url).hostname or "", settings.relay_allow_private)
            timeout = aiohttp.ClientTimeout(total=settings.relay_connect_timeout_s)
            async with guarded_http(settings.relay_allow_private, timeout=timeout) as http:
                async with http.post(url, data=form, headers=headers, allow_redirects=False) as resp:
                    if resp.status < 300:
                        return
                    why = f"HTTP {resp.status}"
                    if resp.status < 500:
                        break  # the application refused it; asking again gets the same answer
        except PrivateAddress as exc:
            why = str(exc)
            break
        except asyncio.TimeoutError:
            why = f"no answer within {settings.relay_connect_timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            refused = private_refusal(exc)
            if refused is not None:
                why = str(refused)
                break
            why = f"could not connect: {type(exc).__name__}"
    log.warning("session %s: status callback to %s failed: %s", session_id, shown_url(url), why,
                extra={"session_id": session_id})
