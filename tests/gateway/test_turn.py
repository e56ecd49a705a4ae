"""TURN REST-auth credentials (coturn `use-auth-secret`)."""

import base64
import hashlib
import hmac

import pytest

from voxgate.gateway.webrtc.turn import turn_credentials


def test_known_vector_computed_with_openssl():
    # printf '%s' "1700003600:sess42" | openssl dgst -sha1 -hmac "north-wind" -binary | base64
    creds = turn_credentials("north-wind", 3600, "sess42", "turn:turn.example.com:3478", now=1700000000)
    assert creds == {
        "urls": ["turn:turn.example.com:3478"],
        "username": "1700003600:sess42",
        "credential": "7suEioK/wT6AJsFPJ/LmdpVeO7I=",
        "ttl": 3600,
    }


def test_credential_is_hmac_sha1_of_the_username_as_coturn_checks_it():
    secret = "s3cr\u00e9t"
    urls = ["turn:10.0.0.5:3478?transport=udp", "turns:turn.example.com:5349"]
    creds = turn_credentials(secret, 600, "abcdef0123456789", urls, now=1234567890.9)
    expiry, user = creds["username"].split(":", 1)
    assert int(expiry) == 1234567890 + 600 and user == "abcdef0123456789"
    # What coturn does on an Allocate: recompute from its own copy of the secret.
    expected = base64.b64encode(
        hmac.new(secret.encode("utf-8"), creds["username"].encode("utf-8"), hashlib.sha1).digest()
    ).decode("ascii")
    assert creds["credential"] == expected
    assert creds["urls"] == urls
    # Another secret or another user gives another credential.
    assert turn_credentials("other", 600, "abcdef0123456789", urls, now=1234567890)["credential"] != expected
    assert turn_credentials(secret, 600, "other", urls, now=1234567890)["credential"] != expected


def test_expiry_follows_the_clock_by_default():
    import time

    before = int(time.time())
    creds = turn_credentials(b"raw-bytes-secret", 60, "s1", "turn:t:3478")
    expiry = int(creds["username"].split(":")[0])
    assert before + 60 <= expiry <= int(time.time()) + 60


@pytest.mark.parametrize("ttl, user", [(0, "s1"), (-5, "s1"), (60, "a:b")])
def test_bad_arguments_are_refused(ttl, user):
    with pytest.raises(ValueError):
        turn_credentials("k", ttl, user, "turn:t:3478", now=0)
