"""The one module that reaches into Ray's internals: Serve's controller, for the replicas' own addresses.

Serve has no public call that lists where its replicas listen themselves (its direct ingress,
in Ray 2.60; its HAProxy integration reads them the same way). engine/cluster/pool_replicas.py lists
them for `GET /v1/replicas` from the controller's target groups, through the names here:
the controller actor's name and namespace, its `get_target_groups` and `get_http_config`,
and the HTTP protocol tag of a group. pyproject.toml pins Ray (the `scale` extra) with an
upper bound; `check` runs at the pool's start (`voxgate engine serve`), which says in its
start-up line whether the listing applies (`summary`), and tests/test_compat_homes.py fails
where the pinned Ray lacks a name. Where a Ray upgrade moves them, the listing is empty, the
log says why, and gateways use Serve's proxy.

Ray is imported only inside these functions: the gateway imports engine/ without the extra.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any

# The controller's methods the listing calls.
_CONTROLLER_METHODS = ("get_target_groups", "get_http_config")


def version() -> str:
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return "?"


def _controller() -> Any:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


async def serve_controller() -> Any:
    """Serve's controller actor: a blocking call to Ray's GCS, so on a thread, off the loop that streams frames."""
    return await asyncio.to_thread(_controller)


async def target_groups(controller: Any, app: str) -> tuple[list, Any]:
    """(the controller's target groups for `app`, Serve's HTTP options). A group has `protocol`,
    `app_name`, `route_prefix` and `targets`, each target `name`, `ip` and `port`."""
    groups, http = await asyncio.gather(controller.get_target_groups.remote(app), controller.get_http_config.remote())
    return groups, http


def target_groups_blocking(app: str) -> list:
    """The controller's target groups for `app`, from a Ray driver that may block (bench/bench_pool.py)."""
    import ray

    return ray.get(_controller().get_target_groups.remote(app))


def serves(group: Any, protocol: str) -> bool:
    """Whether a target group is Serve's `protocol` one: "HTTP" or "GRPC"."""
    from ray.serve._private.common import RequestProtocol

    return group.protocol == getattr(RequestProtocol, protocol)


def check() -> bool:
    """Whether the installed Ray has every name the listing uses (no cluster needed)."""
    try:
        from ray.serve._private.common import RequestProtocol
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE  # noqa: F401
        from ray.serve._private.controller import ServeController
    except ImportError:
        return False
    return hasattr(RequestProtocol, "HTTP") and hasattr(RequestProtocol, "GRPC") and all(hasattr(ServeController, m) for m in _CONTROLLER_METHODS)


def summary(ok: bool) -> str:
    """The start-up line's words for `check()`'s result."""
    if ok:
        return f"replicas listed from Serve's controller (Ray {version()})"
    return f"NO replica listing: Ray {version()}'s Serve controller has moved; gateways use Serve's proxy"
