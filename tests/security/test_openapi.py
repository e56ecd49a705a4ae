"""The OpenAPI 3.1 description at /openapi.json stays true.

It names exactly the routes the server has (no more, no fewer), its schemas
are valid JSON Schema 2020-12, and real responses from a live server, for
success and error alike, match the schemas it gives for them.
"""

from __future__ import annotations

import aiohttp
import jsonschema
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection

from voxgate.config import Settings
from voxgate.gateway.webrtc.ice import restrict_host_addresses
from voxgate.signaling.openapi import spec
from voxgate.signaling.server import create_app

from sec_helpers import http_json


def routes_of_the_app(web: bool) -> set[tuple[str, str]]:
    app = create_app(Settings(engine="tone", web=web))
    out = set()
    for route in app.router.routes():
        if route.method == "HEAD":
            continue  # aiohttp adds HEAD beside every GET
        path = route.resource.canonical
        out.add((route.method.lower(), "/static/{path}" if path == "/static/{path}" else path))
    return out


def routes_of_the_spec(doc: dict) -> set[tuple[str, str]]:
    return {(method, path) for path, item in doc["paths"].items() for method in item}


@pytest.mark.parametrize("web", [True, False])
def test_the_spec_names_exactly_the_servers_routes(web):
    assert routes_of_the_spec(spec(web=web)) == routes_of_the_app(web)


def test_schemas_are_valid_json_schema():
    doc = spec()
    assert doc["openapi"].startswith("3.1")
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert op["responses"], (method, path)


def check(doc: dict, path: str, method: str, status: int, body, content_type: str = "application/json") -> None:
    """`body` matches what the spec says `method path` answers with `status`."""
    responses = doc["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method} {path}: {status} is not documented"
    response = responses[str(status)]
    if "$ref" in response:
        response = doc["components"]["responses"][response["$ref"].rsplit("/", 1)[-1]]
    media = response["content"]
    kind = content_type.split(";")[0].strip()
    assert kind in media or "*/*" in media, f"{method} {path}: {status} {content_type} is not documented"
    if kind == "application/json":
        schema = {"$ref": "#" + "/components/schemas/_", "components": doc["components"]}
        schema["components"] = {**doc["components"], "schemas": {**doc["components"]["schemas"], "_": media[kind]["schema"]}}
        jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)


async def test_live_responses_match_the_spec(tone_server):
    url = tone_server.url
    status, doc, _ = await http_json("GET", url + "/openapi.json")
    assert status == 200 and doc == spec()

    status, body, _ = await http_json("GET", url + "/healthz")
    check(doc, "/healthz", "get", status, body)
    status, body, _ = await http_json("GET", url + "/readyz")
    check(doc, "/readyz", "get", status, body)
    status, made, _ = await http_json("POST", url + "/v1/sessions", body={"voice": "tone"})
    check(doc, "/v1/sessions", "post", status, made)
    sid = made["session_id"]
    status, body, _ = await http_json("GET", f"{url}/v1/ice-servers?token={made['client_token']}")
    check(doc, "/v1/ice-servers", "get", status, body)

    restrict_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    status, answer, _ = await http_json("POST", url + "/v1/offer", body={"sdp": pc.localDescription.sdp, "type": "offer"})
    check(doc, "/v1/offer", "post", status, answer)
    status, body, _ = await http_json("POST", f"{url}/v1/sessions/{answer['session_id']}/candidates",
                                      body={"candidate": None, "token": answer["token"]})
    check(doc, "/v1/sessions/{session_id}/candidates", "post", status, body)
    status, body, _ = await http_json("GET", f"{url}/v1/sessions/{answer['session_id']}")
    check(doc, "/v1/sessions/{session_id}", "get", status, body)
    await pc.close()

    status, body, _ = await http_json("GET", url + "/v1/sessions")
    check(doc, "/v1/sessions", "get", status, body)
    status, body, _ = await http_json("DELETE", f"{url}/v1/sessions/{sid}")
    check(doc, "/v1/sessions/{session_id}", "delete", status, body)

    # Errors, each in the shape the spec gives.
    for method, path, template, kwargs in [
        ("GET", f"/v1/sessions/{sid}", "/v1/sessions/{session_id}", {}),
        ("POST", "/v1/offer", "/v1/offer", {"raw": b"{nope"}),
        ("POST", "/v1/tts", "/v1/tts", {"body": {"text": "hi", "format": "mp3"}}),
        ("POST", "/v1/sessions", "/v1/sessions", {"body": {"voice": "/etc/passwd.onnx"}}),
        ("GET", "/v1/ice-servers?token=x.y", "/v1/ice-servers", {}),
        ("GET", "/v1/sessions/nope/ws", "/v1/sessions/{session_id}/ws", {}),
        ("PUT", "/v1/offer", "/v1/offer", {}),
    ]:
        status, body, headers = await http_json(method, url + path, **kwargs)
        doc_method = "post" if path == "/v1/offer" else method.lower()
        check(doc, template, doc_method, status, body)
        if status == 405:
            assert headers["Allow"] == "POST"

    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/tts", json={"text": "Hi.", "format": "pcm"}) as resp:
            await resp.read()
            check(doc, "/v1/tts", "post", resp.status, None, resp.headers["Content-Type"])
            assert {"X-Sample-Rate", "X-Audio-Format", "X-Max-Audio-S"} <= set(resp.headers)
        async with http.get(url + "/") as resp:
            check(doc, "/", "get", resp.status, None, resp.headers["Content-Type"])
        async with http.get(url + "/metrics") as resp:
            check(doc, "/metrics", "get", resp.status, None, resp.headers["Content-Type"])
