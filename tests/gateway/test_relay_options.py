"""gateway/backends/relay_options.py and the pure parts of gateway/backends/relay.py: the vendors' attributes as a
session's relay options, the address check, the handshake's signature and the language checks."""

from __future__ import annotations

import pytest

from voxgate.gateway.errors import GatewayError
from voxgate.gateway.backends.relay import recognizer_speaks, twilio_signature, voice_for_language
from voxgate.gateway.backends.outbound import private_address
from voxgate.gateway.backends.relay_options import options_from_parameters, parse_options
from voxgate.signaling.twilio_stream import twilio_signature as inbound_signature


def test_attributes_keep_the_vendors_names_and_typos_are_refused():
    opts = parse_options({"url": "wss://app.example/relay", "welcomeGreeting": "Hi", "interruptible": "dtmf",
                          "welcomeGreetingInterruptible": False, "dtmfDetection": "true", "interruptSensitivity": "high",
                          "ttsProvider": "ElevenLabs", "hints": "Voxgate"})
    assert (opts.welcome_greeting, opts.interruptible, opts.welcome_greeting_interruptible) == ("Hi", "dtmf", "none")
    assert opts.dtmf_detection is True and opts.interrupt_sensitivity == "high"
    assert opts.ignored == {"ttsProvider": "ElevenLabs", "hints": "Voxgate"}
    for bad in ({"url": "https://app.example/"}, {"url": "wss://a/", "welcomeGreting": "Hi"},
                {"url": "wss://a/", "interruptible": "sometimes"}, {"url": "wss://a/", "customParameters": {"a": 1}}):
        with pytest.raises(GatewayError):
            parse_options(bad)


def test_bridge_parameters_split_into_attributes_and_the_apps_own_custom_parameters():
    opts = options_from_parameters({"relay_url": "ws://app/r", "token": "t", "session_id": "s", "welcomeGreeting": "Hi",
                                    "customer": "42"}, default_url=None)
    assert opts is not None and opts.url == "ws://app/r" and opts.welcome_greeting == "Hi"
    assert opts.custom_parameters == {"customer": "42"}  # never the token
    assert options_from_parameters({"customer": "42"}, default_url=None) is None
    assert options_from_parameters({}, default_url="wss://default/").url == "wss://default/"


def test_private_addresses():
    for host in ("127.0.0.1", "10.0.0.1", "192.168.1.1", "172.16.0.1", "169.254.169.254", "::1", "fd00::1",
                 "::ffff:127.0.0.1", "0.0.0.0", "100.64.0.1"):
        assert private_address(host), host
    for host in ("8.8.8.8", "2001:4860:4860::8888", "app.example"):
        assert not private_address(host), host  # a name is checked on what it resolves to


def test_action_is_the_status_callback_url():
    assert parse_options({"url": "ws://app/r", "action": "https://app/ended"}).action == "https://app/ended"
    assert parse_options({"url": "ws://app/r", "statusCallback": "http://app/s"}).action == "http://app/s"
    opts = options_from_parameters({"relay_url": "ws://app/r", "action": "https://app/ended", "customer": "42"}, None)
    assert opts is not None and opts.action == "https://app/ended" and opts.custom_parameters == {"customer": "42"}
    for bad in ("ftp://app/x", "wss://app/x", "/relative", 42):
        with pytest.raises(GatewayError, match="relay.action"):
            parse_options({"url": "ws://app/r", "action": bad})


def test_the_handshake_is_signed_as_twilio_signs_and_checks():
    assert twilio_signature("token", "wss://app.example/relay?x=1") == inbound_signature("token", "wss://app.example/relay?x=1")
    assert twilio_signature("token", "wss://a/") != twilio_signature("other", "wss://a/")


def test_languages_of_voices_and_recognizers():
    voices = ["en_US-lessac-medium", "en_GB-alan-low", "es_ES-davefx-medium"]
    assert voice_for_language(voices, "en-GB") == "en_GB-alan-low"
    assert voice_for_language(voices, "en-AU") == "en_US-lessac-medium"  # the language, another region
    assert voice_for_language(voices, "es") == "es_ES-davefx-medium"
    assert voice_for_language(voices, "fr-FR") is None
    assert voice_for_language(["tone"], "fr-FR") == "tone"  # a voice without a language speaks any
    assert recognizer_speaks("pocketsphinx", "en-US") and not recognizer_speaks("pocketsphinx", "es-ES")
    assert recognizer_speaks("openai", "es-ES") and not recognizer_speaks(None, "en-US")
