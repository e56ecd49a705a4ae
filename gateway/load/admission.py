"""Admission: whether this gateway takes one more session or request, and whether it is ready.

Every check that can turn a new session away lives here, in one place, so that every
way in (an offer without a session, POST /v1/sessions, a Twilio stream, POST /v1/tts and
the other speech requests) is refused for the same reasons with the same answer; the
HTTP surface only maps the `GatewayError` to a response.

The limits that count things (--max-sessions, the sessions made without a token, per
client address, per API key, /v1/tts at once) come first. Then the node's load, measured:

- the budget: the seconds of audio per second the node can speak, a real-time factor.
  With a local engine worker, the cores left over by other processes (at least
  MIN_CORE_SHARE of them), less a reserve,
  over what one second of a speaking session costs them: the worker's synthesis
  (engine/runtime/capacity.py: measured at start and kept current from its steps) plus this
  process's media (its own CPU per speaking session, measured; MEDIA_COST_S until
  measured). With an engine pool (--engine-url), the pool's replicas report what they
  carry and can carry (engine/cluster/remote.py), and the budget is what they have left for
  this gateway, within what its own cores can encode. `--synthesis-budget` fixes it.
- the demand: each session speaking now counts 1; each other joined session the larger of
  --talk-share (the share of the time a conversation is expected to speak) and its own
  share over the last few minutes; a session no peer or call has joined yet --unjoined-share
  of --talk-share, for its first --unjoined-hold-s only (then 0, and it is admitted again
  when it is joined); each speech request in flight its slots (1, a compressed format 2).
- the event loop's lag and the share of late frames over the last LAG_WINDOW_S; where one
  tenant's own work made the frames late, only that tenant is refused for them
  (gateway/load/late_blame.py).

Sessions made without a key or token leave --key-reserve of the budget to keys, and one
key's unjoined sessions made ahead may take at most --made-ahead-share of it (issue 53).

A new session is admitted while the demand with it (its --talk-share) stays within the
budget, and the loop keeps time; otherwise 503 `at_capacity` with Retry-After (and, in a
fleet, the URL of a gateway with room). /readyz turns 503 --ready-margin of the budget
before that, so that load balancers stop sending first. A session once admitted is never
refused for load later: its utterances are the worker's to protect (engine/runtime/worker.py).
"""

from __future__ import annotations

import ipaddress
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Protocol

from ...engine.runtime.capacity import LISTENER_MEDIA_COST, RESERVE, CoreShare
from ..errors import GatewayError
from .late_blame import LateBlame, address_tenant, key_tenant
from .view import GatewayView

if TYPE_CHECKING:
    from ..sessions.session import Session

# Sent with a refusal for capacity: the client may try again shortly.
RETRY_LATER = {"Retry-After": "5"}
# What the media of one speaking session costs this process, in cores, until measured:
# a cautious default above the figures in docs/benchmarks.md; the worker plans with the same figure.
MEDIA_COST_S = LISTENER_MEDIA_COST
# The measured media cost is taken only from seconds with at least this many sessions
# speaking (fewer say more about the process's fixed costs than about media), and is
# kept within these bounds.
MEDIA_SAMPLE_SESSIONS = 4
MEDIA_COST_RANGE = (0.002, 0.2)
MEDIA_WEIGHT = 0.05  # per sample: about 20 s of speech to move it
# A session's own talk share is a moving average over about this long.
TALK_SHARE_TAU_S = 120.0
# The loop must keep time: over the last LAG_WINDOW_S, at most a tenth of its 100 ms
# ticks may come later than MAX_LOOP_LAG_S, and at most MAX_LATE_SHARE of the frames
# sent (of at least LATE_MIN_FRAMES) go out more than 5 ms late.
LAG_WINDOW_S = 10.0
MAX_LOOP_LAG_S = 0.05
MAX_LATE_SHARE = 0.05
LATE_MIN_FRAMES = 500
# Other processes' busy cores shrink the budget, but never below this share of the node's
# cores: a build or a test run on the same host passes, and a node must not lock itself
# out for it (the worker still protects started speech if they stay).
MIN_CORE_SHARE = 0.5

# Why a session or request was refused: the label of voxgate_sessions_rejected_total.
REASONS = ("draining", "max_sessions", "anonymous", "address_limit", "key_limit", "tts_concurrency",
           "synthesis", "loop_lag", "late_frames")


def _is_loopback(address: str) -> bool:
    # Local tools (voxgate probe, the benchmarks) are not limited per address; a
    # reverse proxy on the same host must be named with --trusted-proxy so that
    # its clients are told apart.
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@dataclass
class LoadFigures:
    """The node's load as admission sees it; real-time factors are seconds of audio per second."""

    budget: float  # what the node can speak (inf: unmeasured)
    demand_now: float  # what it speaks now
    expected: float  # what its sessions are expected to speak (the demand admission plans with)
    engine_cost: float | None  # core-seconds of synthesis per audio second (None: a pool's, or unmeasured)
    media_cost: float  # this process's cores per speaking session
    free_cores: float  # usable cores less other processes' busy ones
    talk_share: float  # the share of session time spent speaking over the last minutes, measured
    loop_lag: float  # the 90th percentile of the loop's lag over the last LAG_WINDOW_S
    late_share: float  # frames sent late over the last LAG_WINDOW_S

    @property
    def headroom(self) -> float:
        """Real-time factor left: what more the node could be asked to speak."""
        return self.budget - self.expected


class AdmissionHost(GatewayView, Protocol):
    """What admission reads of the gateway it guards (gateway/gateway.py's Gateway, which owns it):
    besides the view every part has, the sessions and who made them, and whether it accepts any;
    and the speech slots taken by requests, which admission counts in and out."""

    tts_active: int

    @property
    def sessions(self) -> Mapping[str, Session]: ...

    @property
    def anonymous(self) -> Mapping[str, str]: ...  # session id -> client address, for those made without a token

    @property
    def accepting(self) -> bool: ...

    def joined(self, session_id: str) -> bool: ...


class Admission:
    """The gateway's admission checks and the load they read (one per Gateway)."""

    def __init__(self, gateway: AdmissionHost, share: CoreShare | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.gw = gateway
        self.settings = gateway.settings
        self.share = share or CoreShare((0,))
        self.clock = clock
        self.media_cost = MEDIA_COST_S
        self._recent: dict[str, float] = {}  # session id -> its speaking share, moving average
        self._requests: dict[str, int] = {}  # speech requests in flight per caller
        self._talk_share = 0.0  # every session's, weighted by time
        self._lags: deque = deque(maxlen=int(LAG_WINDOW_S / 0.1) + 1)
        self._frames: deque = deque()  # (when, late, sent) snapshots of the pacer counters
        self._last_tick: float | None = None
        self._cpu0: float | None = None
        self._underruns = 0  # the engine's underruns counted into voxgate_speech_underruns_total{where="engine"}
        # Whose work made the frames late, when they are (gateway/load/late_blame.py).
        self.blame = LateBlame(LAG_WINDOW_S)
        # Called for a gateway that has room, when this one has none (the fleet's directory).
        self.elsewhere: Callable[[], str | None] = lambda: None
        self.figures = self._figures()

    # Inputs, fed by the gateway
    def loop_lag(self, lag: float) -> None:
        self._lags.append(lag)

    def tick(self) -> None:
        """Once a second: other processes' load, the media's cost, each session's talk share, late frames."""
        now = self.clock()
        span = None if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        pid = self.gw.engine.worker_pid
        self.share.ours = [0, pid] if pid else [0]
        self.share.sample(now)
        speaking = [s for s in self.gw.sessions.values() if s.speaking]
        own_spent = 0.0
        if span:
            own = _own_cpu_s()
            own_spent = own - self._cpu0 if self._cpu0 is not None else 0.0
            if self._cpu0 is not None and len(speaking) >= MEDIA_SAMPLE_SESSIONS:
                sample = (own - self._cpu0) / span / len(speaking)
                low, high = MEDIA_COST_RANGE
                self.media_cost += (min(high, max(low, sample)) - self.media_cost) * MEDIA_WEIGHT
            self._cpu0 = own
            weight = min(1.0, span / TALK_SHARE_TAU_S)
            for sid, session in self.gw.sessions.items():
                recent = self._recent.get(sid, 0.0)
                self._recent[sid] = recent + ((1.0 if session.speaking else 0.0) - recent) * weight
            if self.gw.sessions:
                self._talk_share += (len(speaking) / len(self.gw.sessions) - self._talk_share) * weight
        else:
            self._cpu0 = _own_cpu_s()
        for sid in [sid for sid in self._recent if sid not in self.gw.sessions]:
            del self._recent[sid]
        m = self.gw.metrics
        self._frames.append((now, m.frames_late, m.frames_sent))
        while self._frames and now - self._frames[0][0] > LAG_WINDOW_S:
            self._frames.popleft()
        self.figures = self._figures()
        if span:
            self.blame.tick(span, own_spent, self.figures.late_share > MAX_LATE_SHARE)
        m.synthesis_budget.set(self.figures.budget if math.isfinite(self.figures.budget) else -1)
        m.synthesis_demand.labels("now").set(self.figures.demand_now)
        m.synthesis_demand.labels("expected").set(self.figures.expected)
        m.synthesis_cost.labels("engine").set(self.figures.engine_cost or 0.0)
        m.synthesis_cost.labels("media").set(self.figures.media_cost)
        m.talk_share.set(self.figures.talk_share)
        underruns = getattr(self.gw.engine, "underruns", 0)
        if underruns > self._underruns:
            m.speech_underruns.labels("engine").inc(underruns - self._underruns)
            self._underruns = underruns

    # What the node carries
    def budget(self) -> float:
        """Seconds of audio per second this node can speak (inf while nothing is measured)."""
        if self.settings.synthesis_budget:
            return float(self.settings.synthesis_budget)
        free = self.free_cores() * (1.0 - RESERVE)
        pool = getattr(self.gw.engine, "pool_load", None)
        if callable(pool):
            load = pool()
            media = free / self.media_cost
            if load is None:
                return media
            # What the pool's replicas can still carry, with this gateway's own speakers counted back in.
            own = sum(1 for s in self.gw.sessions.values() if s.speaking) + self.gw.tts_active
            return min(media, max(0.0, load.capacity - max(0.0, load.speaking - own)))
        cost = self.engine_cost()
        return free / ((cost or 0.0) + self.media_cost)

    def free_cores(self) -> float:
        """The cores admission plans with: the usable ones less other processes' (at least MIN_CORE_SHARE)."""
        return max(self.share.cores * MIN_CORE_SHARE, self.share.free_cores)

    def engine_cost(self) -> float | None:
        load = getattr(self.gw.engine, "load", None)
        cost = getattr(load, "cost", None)
        if cost is None:
            cost = self.gw.engine.info.get("synthesis_cost")
        return cost if isinstance(cost, (int, float)) and cost > 0 else None

    def expected(self) -> tuple[float, float]:
        """(demand now, expected demand): speaking sessions and requests count 1 (a request
        in a compressed format its weight); joined sessions the larger of --talk-share and
        their own recent share; a session not joined yet (unjoined_weight) less, and soon nothing."""
        share = self.settings.talk_share
        now = float(self.gw.tts_active)
        expected = now
        clock = self.clock()
        for sid, session in self.gw.sessions.items():
            if session.speaking:
                now += 1.0
                expected += 1.0
            elif self.gw.joined(sid):
                expected += max(share, self._recent.get(sid, 0.0))
            else:
                expected += self.unjoined_weight(session, clock)
        return now, expected

    def unjoined_weight(self, session, now: float) -> float:
        """What a session that no peer or call has joined yet counts: --unjoined-share of
        --talk-share for its first --unjoined-hold-s, then nothing. An offer that never
        finishes ICE, or a session made ahead that nobody joins, does not speak; counted
        in full, thirty of them filled the budget (issue 53, finding 3)."""
        s = self.settings
        if now - session.created_at >= s.unjoined_hold_s:
            return 0.0
        return s.talk_share * s.unjoined_share

    def _unjoined_of(self, key: str) -> int:
        """Sessions the API key made ahead that nothing has joined yet."""
        return sum(1 for sid in self.gw.registry.by_key.get(key, ()) if not self.gw.joined(sid))

    def _figures(self) -> LoadFigures:
        now, expected = self.expected()
        lags = sorted(self._lags)
        lag = lags[int(0.9 * (len(lags) - 1))] if lags else 0.0
        late = 0.0
        if len(self._frames) >= 2:
            (_, late0, sent0), (_, late1, sent1) = self._frames[0], self._frames[-1]
            if sent1 - sent0 >= LATE_MIN_FRAMES:
                late = (late1 - late0) / (sent1 - sent0)
        return LoadFigures(
            budget=self.budget(), demand_now=now, expected=expected, engine_cost=self.engine_cost(),
            media_cost=self.media_cost, free_cores=self.free_cores(), talk_share=self._talk_share,
            loop_lag=lag, late_share=late,
        )

    # Decisions
    def _late(self, f: LoadFigures, tenant: str | None) -> bool:
        """Whether late frames refuse `tenant`: all are refused, unless one tenant's own work is to
        blame for them (gateway/load/late_blame.py), when only that one is."""
        if f.late_share <= MAX_LATE_SHARE:
            return False
        return self.blame.culprit is None or self.blame.culprit == tenant

    def _overloaded(self, need: float, margin: float = 0.0, tenant: str | None = None) -> str | None:
        """Why the node cannot take `need` more real-time factor now for `tenant` (None: it can)."""
        f = self._figures()
        self.figures = f
        if f.loop_lag > MAX_LOOP_LAG_S:
            return "loop_lag"
        if self._late(f, tenant):
            return "late_frames"
        if f.expected + need > f.budget * (1.0 - margin):
            return "synthesis"
        return None

    def _refuse(self, reason: str, code: str, message: str, status: int = 503, headers: dict | None = None) -> GatewayError:
        self.gw.metrics.rejected.labels(reason).inc()
        detail = {"reason": reason}
        if status == 503 and reason not in ("draining",):
            other = self.elsewhere()
            if other:
                detail["gateway"] = other
        return GatewayError(code, message, status, headers=headers, detail=detail)

    def admit_session(self, anonymous_from: str | None = None, key: str | None = None, key_sessions: int = 0,
                      made_ahead: bool = False) -> None:
        """Raises GatewayError unless a new session may be made now. `anonymous_from`: the
        client address of a session made without a key or token; `key`, `key_sessions`:
        the API key making it and how many sessions it holds; `made_ahead`: made for a
        peer or call to join later (POST /v1/sessions)."""
        gw, s = self.gw, self.settings
        if key is not None and key_sessions >= s.max_sessions_per_key:
            raise self._refuse("key_limit", "key_limit", f"this API key holds its maximum of {s.max_sessions_per_key} sessions", 429)
        if key is not None and made_ahead:
            # The budget bounds what one key may book ahead, not only --max-sessions-per-key:
            # its unjoined sessions, each at --talk-share, within --made-ahead-share of the budget.
            budget = self._figures().budget
            unjoined = self._unjoined_of(key)
            if math.isfinite(budget) and (unjoined + 1) * s.talk_share > s.made_ahead_share * budget:
                raise self._refuse("key_limit", "key_limit", f"this API key holds {unjoined} sessions made ahead that "
                                   f"nothing has joined, its share of the server's budget; join or end one first", 429)
        if not gw.accepting:
            raise self._refuse("draining", "draining", "the server is shutting down; retry on another instance")
        if len(gw.sessions) + gw.tts_active >= s.max_sessions:
            raise self._refuse("max_sessions", "at_capacity", f"the server holds its maximum of {s.max_sessions} sessions; "
                               "retry later", headers=RETRY_LATER)
        if anonymous_from is not None:
            budget = s.anonymous_budget
            if len(gw.anonymous) >= budget:
                raise self._refuse("anonymous", "at_capacity", f"the server holds its maximum of {budget} sessions made "
                                   "without a token; retry later, or join a session made through POST /v1/sessions",
                                   headers=RETRY_LATER)
            per_address = s.max_sessions_per_address
            if per_address and not _is_loopback(anonymous_from) and \
                    sum(1 for a in gw.anonymous.values() if a == anonymous_from) >= per_address:
                raise self._refuse("address_limit", "address_limit", f"this client address holds its maximum of "
                                   f"{per_address} sessions made without a token", 429)
        # With keys configured, --key-reserve of the budget is kept for them: offers without
        # a key or token cannot fill it.
        reserve = s.key_reserve if anonymous_from is not None and s.api_key else 0.0
        tenant = key_tenant(key) if key is not None else address_tenant(anonymous_from) if anonymous_from else None
        why = self._overloaded(s.talk_share, reserve, tenant)
        if why is not None:
            raise self._refuse(why, "at_capacity", self._busy_message(why), headers=RETRY_LATER)

    def admit_join(self, session) -> None:
        """Raises GatewayError unless a peer or call may join `session` now: one that waited
        past --unjoined-hold-s counts nothing any more, so it is admitted again."""
        if self.clock() - session.created_at < self.settings.unjoined_hold_s:
            return  # its room is still counted
        why = self._overloaded(self.settings.talk_share)
        if why is not None:
            raise self._refuse(why, "at_capacity", self._busy_message(why), headers=RETRY_LATER)

    def start_request(self, caller: str, slots: int = 1, tenant: str | None = None) -> None:
        """Raises GatewayError unless a speech request (POST /v1/tts and its kin) from
        `caller` (its API key, or its client address without keys) may start now;
        else counts it until `end_request(caller, slots)`. It takes `slots` of the
        --tts-max-concurrent slots, of --max-sessions' and of the budget: a compressed
        format's encode costs more than a WAV's (gateway/peerless/http_audio.py)."""
        gw, s = self.gw, self.settings
        retry = {"Retry-After": "1"}
        if not gw.accepting:
            raise self._refuse("draining", "draining", "the server is shutting down; retry on another instance")
        if gw.tts_active + slots > s.tts_max_concurrent or len(gw.sessions) + gw.tts_active + slots > s.max_sessions:
            raise self._refuse("tts_concurrency", "at_capacity", "the server is synthesizing its maximum of requests; "
                               "retry in a moment", headers=retry)
        if self._requests.get(caller, 0) >= s.tts_max_concurrent_per_key:
            raise self._refuse("tts_concurrency", "too_many_requests", f"this caller has {s.tts_max_concurrent_per_key} "
                               "requests synthesizing; wait for one to finish", 429, headers=retry)
        why = self._overloaded(float(slots), tenant=tenant)
        if why is not None:
            raise self._refuse(why, "at_capacity", self._busy_message(why), headers=retry)
        self._requests[caller] = self._requests.get(caller, 0) + 1
        gw.tts_active += slots

    def end_request(self, caller: str, slots: int = 1) -> None:
        self.gw.tts_active -= slots
        left = self._requests.get(caller, 1) - 1
        if left > 0:
            self._requests[caller] = left
        else:
            self._requests.pop(caller, None)

    def speech_slot(self, caller: str, slots: int = 1, tenant: str | None = None) -> "SpeechSlot":
        """A speech request's `slots` (start_request), held until the slot is released:
        `with gw.admission.speech_slot(caller):` around a request, or `release()` when
        the request ends elsewhere (a /v1/tts/ws context). Releasing twice is harmless,
        so no route can end a request twice, and `with` cannot forget to end it."""
        self.start_request(caller, slots, tenant)
        return SpeechSlot(self, caller, slots)

    def ready(self) -> tuple[bool, str | None]:
        """Whether load balancers should send new sessions here: --ready-margin of the budget before admission refuses."""
        gw = self.gw
        if not gw.accepting:
            return False, "draining"
        if not gw.engine.ready:
            return False, "engine"
        if len(gw.sessions) >= self.settings.max_sessions:
            return False, "max_sessions"
        why = self._overloaded(self.settings.talk_share, self.settings.ready_margin)
        return why is None, why

    def fleet_load(self) -> tuple[float, float]:
        """(budget, demand) as the fleet's directory publishes them for placement: a node that
        refuses every new session for now (draining, engine not ready, its maximum of
        sessions, a late loop) has its budget cut to its demand, so no headroom."""
        gw = self.gw
        f = self._figures()
        self.figures = f
        full = (not gw.accepting or not gw.engine.ready or len(gw.sessions) + gw.tts_active >= self.settings.max_sessions
                or f.loop_lag > MAX_LOOP_LAG_S or self._late(f, None))
        return (min(f.budget, f.expected) if full else f.budget), f.expected

    def _busy_message(self, why: str) -> str:
        f = self.figures
        if why == "loop_lag":
            return f"the server's event loop is running {1000 * f.loop_lag:.0f} ms late; retry later"
        if why == "late_frames":
            return f"the server sends {100 * f.late_share:.1f} % of its frames late; retry later"
        return (f"the server speaks at its capacity (expected {f.expected:.1f} of a budget of {f.budget:.1f} seconds "
                "of audio per second); retry later")


class SpeechSlot:
    """One admitted speech request (Admission.speech_slot)."""

    def __init__(self, admission: Admission, caller: str, slots: int = 1) -> None:
        self._admission: Admission | None = admission
        self._caller = caller
        self._slots = slots

    def release(self) -> None:
        if self._admission is not None:
            admission, self._admission = self._admission, None
            admission.end_request(self._caller, self._slots)

    def __enter__(self) -> "SpeechSlot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system
