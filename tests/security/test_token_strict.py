"""Finding 15: client tokens decode strictly; a stray character is an invalid token.

Before, the lenient base64 decoder skipped characters outside the alphabet,
so an altered token still verified.
"""

from __future__ import annotations

import pytest

from voxgate.gateway.errors import GatewayError
from voxgate.gateway.sessions.registry import TokenSigner

from sec_helpers import http_json

SIGNER = TokenSigner("secret", 300)


def altered(token: str) -> list[str]:
    body, sig = token.split(".")
    return [
        body + "!." + sig, body + "." + sig + "!", body + ".=" + sig, body + "." + sig + "=",
        body[:4] + " " + body[4:] + "." + sig, body + "." + sig[:5] + "\n" + sig[5:], body + "." + sig + "A",
        "+" + body + "." + sig, body + "!!!!." + sig, body + "." + sig[:5] + "!!!!" + sig[5:],
    ]


def test_a_token_verifies_as_issued():
    assert SIGNER.verify(SIGNER.issue("abc123")) == "abc123"


@pytest.mark.parametrize("index", range(10))
def test_any_stray_character_is_refused(index):
    token = altered(SIGNER.issue("abc123"))[index]
    with pytest.raises(GatewayError) as refused:
        SIGNER.verify(token)
    assert refused.value.status == 401 and refused.value.code == "invalid_token"


async def test_the_server_refuses_an_altered_token(tone_server):
    status, made, _ = await http_json("POST", tone_server.url + "/v1/sessions")
    token = made["client_token"]
    body, sig = token.split(".")
    # Four stray characters keep the length a multiple of four: the old decoder skipped them and verified.
    status, reply, _ = await http_json("POST", tone_server.url + "/v1/offer", body={"sdp": "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=mid:0\r\n", "token": body + "." + sig[:5] + "!!!!" + sig[5:]})
    assert status == 401 and reply["error"]["code"] == "invalid_token"
