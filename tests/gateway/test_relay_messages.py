"""gateway/backends/relay_messages.py: what an application sends, checked as the vendors document it."""

from __future__ import annotations

import pytest

from voxgate.gateway.backends import relay_messages as wire


def test_documented_examples_are_taken_with_the_documented_defaults():
    assert wire.check({"type": "text", "token": "Hello", "last": False}) == {
        "type": "text", "token": "Hello", "last": False, "interruptible": True, "preemptible": False, "lang": None}
    assert wire.check({"type": "sendDigits", "digits": "1234#"})["digits"] == "1234#"
    assert wire.check({"type": "language", "ttsLanguage": "es-ES", "transcriptionLanguage": "es-ES"})["ttsLanguage"] == "es-ES"
    assert wire.check({"type": "end"}) == {"type": "end", "handoffData": None}
    assert wire.check({"type": "play", "source": "https://example.com/a.mp3"})["source"] == "https://example.com/a.mp3"


@pytest.mark.parametrize("message", [
    [], "text", {"type": 1}, {"type": "Text", "token": "a"}, {"type": "text", "token": 5}, {"type": "text", "token": "a", "last": "yes"},
    {"type": "text", "token": "\ud800"}, {"type": "text", "token": "a", "extra": 1}, {"type": "sendDigits", "digits": ""},
    {"type": "sendDigits", "digits": "1" * 65}, {"type": "language"}, {"type": "language", "ttsLanguage": "en US; drop"},
    {"type": "end", "handoffData": {"a": 1}}, {"type": "end", "handoffData": "x" * 20000}, {"type": "play"},
    {"type": "text", "token": "a", "lang": {"a": [[[[[[[[[[1]]]]]]]]]]}},
])
def test_malformed_messages_are_refused_with_a_description(message):
    with pytest.raises(wire.RelayMessageError) as refused:
        wire.check(message)
    assert str(refused.value).startswith("Invalid message")
