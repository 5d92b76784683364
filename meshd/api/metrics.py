"""Requests in flight, recent speed, and the Prometheus ``/metrics`` exposition.

The API is where a request enters and leaves this daemon, so it is the one
place that can time what a user experiences: time to first token (TTFT) and
time per output token. ``meshd status`` shows the recent window next to the
planner's prediction; ``GET /metrics`` exposes the same measurements as
Prometheus histograms and counters, plus the mesh's state (plan version,
members by state, this device's stage: KV tokens, busy time, bytes sent;
per peer: link round trip, reachability, activation bytes sent), read from
the daemon's status at scrape time.

Each app has its own ``CollectorRegistry`` (never the process-global one), so
several daemons or test servers in one process do not share counters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# TTFT on CPU meshes runs from tens of ms (short prompt, small model) to a minute.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


@dataclass(frozen=True)
class RequestRecord:
    finished_at: float
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_s: float  # first token to last token


class ApiMetrics:
    """Counts requests in flight, keeps the last ``window`` finished ones, feeds Prometheus."""

    def __init__(self, window: int = 32, clock=time.monotonic):
        self.in_flight = 0
        self.waiting = 0  # admitted, no token yet (queued behind others, or in prefill)
        self.served = 0
        self.failed = 0
        self._recent: deque[RequestRecord] = deque(maxlen=window)
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("meshd_requests", "Generation requests finished, by API, endpoint "
                                "and outcome (ok, error, cancelled)",
                                ["api", "endpoint", "outcome"], registry=r)
        self.rejected = Counter("meshd_requests_rejected", "Requests answered with an error before "
                                "generating, by HTTP status", ["status"], registry=r)
        self.ttft = Histogram("meshd_time_to_first_token_seconds", "Time from a request's arrival "
                              "to its first generated token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("meshd_time_per_output_token_seconds", "Mean time between output "
                              "tokens of a request, after the first", buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("meshd_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("meshd_generation_tokens", "Tokens generated", registry=r)
        Gauge("meshd_requests_in_flight", "Generation requests being served now",
              registry=r).set_function(lambda: self.in_flight)
        Gauge("meshd_queue_depth", "Requests admitted that have not produced a token yet (waiting "
              "for their turn or in prefill)", registry=r).set_function(lambda: self.waiting)
        self.auth_failures = Counter("meshd_auth_failures", "Requests refused for a missing or "
                                     "wrong API key (401) or too many failures (429)", ["status"],
                                     registry=r)

    def started(self) -> float:
        self.in_flight += 1
        self.waiting += 1
        return self.clock()

    def first_token(self) -> None:
        self.waiting -= 1

    def finished(
        self, started_at: float, first_token_at: float | None, prompt_tokens: int,
        completion_tokens: int, *, ok: bool = True, api: str = "openai", endpoint: str = "",
        outcome: str | None = None,
    ) -> RequestRecord:
        now = self.clock()
        self.in_flight -= 1
        if first_token_at is None:
            self.waiting -= 1
        if not ok:
            self.failed += 1
        self.served += 1
        rec = RequestRecord(
            finished_at=now,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            ttft_s=None if first_token_at is None else first_token_at - started_at,
            decode_s=0.0 if first_token_at is None else now - first_token_at,
        )
        self.requests.labels(api, endpoint, outcome or ("ok" if ok else "error")).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if rec.ttft_s is not None:
            self.ttft.observe(rec.ttft_s)
        if completion_tokens > 1 and rec.decode_s > 0:
            self.tpot.observe(rec.decode_s / (completion_tokens - 1))
        if ok and completion_tokens:
            self._recent.append(rec)
        return rec

    def recent(self) -> dict:
        """Aggregate speed over the recent window (``None`` when nothing was served).

        tokens/s counts tokens after the first over the time after the first,
        so it measures decoding and is not diluted by prefill (that is TTFT).
        """
        recs = list(self._recent)
        decode_tokens = sum(max(r.completion_tokens - 1, 0) for r in recs)
        decode_s = sum(r.decode_s for r in recs)
        ttfts = sorted(r.ttft_s for r in recs if r.ttft_s is not None)
        return {
            "requests": len(recs),
            "tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
            "ttft_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
            "served": self.served,
            "failed": self.failed,
        }


# --------------------------------------------------------------------------- the mesh


class MeshCollector:
    """Mesh gauges from the daemon's status dict, read when Prometheus scrapes.

    ``snapshot`` is refreshed by the ``/metrics`` handler (the status provider
    may be async; collectors are not), then ``collect`` renders it.
    """

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self):
        s = self.snapshot
        plan = s.get("plan") or {}
        g = GaugeMetricFamily("meshd_plan_version", "Version of the plan this device serves (0: none)")
        g.add_metric([], float(plan.get("version") or 0))
        yield g
        members = GaugeMetricFamily("meshd_members", "Members of the home by state", labels=["state"])
        counts: dict[str, int] = {}
        for m in s.get("members") or []:
            if isinstance(m, dict):
                counts[str(m.get("state"))] = counts.get(str(m.get("state")), 0) + 1
        for state in ("ready", "joining", "suspect", "gone", "offline"):
            counts.setdefault(state, 0)
        for state, n in sorted(counts.items()):
            members.add_metric([state], n)
        yield members
        ready = GaugeMetricFamily("meshd_ready", "1 when a request sent now would be served at once")
        ready.add_metric([], 1.0 if s.get("ready") else 0.0)
        yield ready
        up = s.get("uptime_s")
        if isinstance(up, (int, float)):
            u = GaugeMetricFamily("meshd_uptime_seconds", "Seconds since this daemon started")
            u.add_metric([], float(up))
            yield u
        stage = s.get("stage")
        if isinstance(stage, dict):
            layers = stage.get("layers") or [0, 0]
            label = [f"{layers[0]}-{layers[1]}"]
            for key, name, doc in (
                ("kv_tokens_in_use", "meshd_stage_kv_tokens_in_use", "KV cache tokens held by this device's stage"),
                ("kv_tokens_max", "meshd_stage_kv_tokens_max", "KV cache token budget of this device's stage"),
                ("sequences", "meshd_stage_sequences", "Sequences with KV on this device's stage"),
            ):
                if isinstance(stage.get(key), (int, float)):
                    gm = GaugeMetricFamily(name, doc, labels=["layers"])
                    gm.add_metric(label, float(stage[key]))
                    yield gm
            for key, name, doc in (
                ("busy_s", "meshd_stage_busy_seconds", "Seconds this device's stage spent computing "
                 "(rate() of it is the stage's busy fraction)"),
                ("forwards", "meshd_stage_forwards", "Stage forwards computed"),
                ("activation_bytes_out", "meshd_link_bytes_sent", "Activation bytes this stage sent "
                 "down the pipeline"),
            ):
                if isinstance(stage.get(key), (int, float)):
                    c = CounterMetricFamily(name, doc, labels=["layers"])
                    c.add_metric(label, float(stage[key]))
                    yield c
            if isinstance(stage.get("busy_s"), (int, float)) and isinstance(up, (int, float)) and up > 0:
                b = GaugeMetricFamily("meshd_stage_busy_fraction", "Fraction of the daemon's uptime "
                                      "this device's stage spent computing", labels=["layers"])
                b.add_metric(label, min(1.0, float(stage["busy_s"]) / up))
                yield b
            yield from _outline_metrics(stage.get("outline"))
            yield from _prefix_metrics(stage.get("prefix_cache"), label)
            yield from _exit_metrics(stage.get("exits"), label)
            yield from _cloud_metrics(stage.get("cloud"))
        links = s.get("links")
        if isinstance(links, dict) and links:
            links = sorted((str(p), i) for p, i in links.items() if isinstance(i, dict))
            rtt = GaugeMetricFamily("meshd_link_rtt_seconds", "Last measured round trip to a peer over "
                                    "the control link (absent while the peer does not answer)",
                                    labels=["peer"])
            up = GaugeMetricFamily("meshd_link_reachable", "1 when the peer answered its recent "
                                   "round-trip probes", labels=["peer"])
            sent = CounterMetricFamily("meshd_link_activation_bytes_sent", "Activation bytes this "
                                       "device's stage sent to a peer", labels=["peer"])
            for peer, info in links:
                if _number(info.get("rtt_s")):
                    rtt.add_metric([peer], float(info["rtt_s"]))
                if isinstance(info.get("reachable"), bool):
                    up.add_metric([peer], 1.0 if info["reachable"] else 0.0)
                if _number(info.get("bytes_sent")):
                    sent.add_metric([peer], float(info["bytes_sent"]))
            yield rtt
            yield up
            yield sent


def _prefix_metrics(p: Any, label: list[str]):
    """The prefix cache: this stage's entries (held, reused, evicted) and the requests this device
    coordinated (how many reused a prefix, and how much)."""
    if not isinstance(p, dict):
        return
    for key, name, doc, kind in (
        ("held_tokens", "meshd_prefix_cache_held_tokens", "KV positions this stage keeps for later prompts",
         GaugeMetricFamily),
        ("entries", "meshd_prefix_cache_entries", "Finished requests this stage keeps as cached prefixes",
         GaugeMetricFamily),
        ("reused_tokens", "meshd_prefix_cache_stage_reused_tokens", "Positions this stage did not compute "
         "again (requests forked from a cached prefix)", CounterMetricFamily),
        ("evictions", "meshd_prefix_cache_evictions", "Cached prefixes this stage evicted", CounterMetricFamily),
    ):
        if _number(p.get(key)):
            m = kind(name, doc, labels=["layers"])
            m.add_metric(label, float(p[key]))
            yield m
    req = p.get("requests")
    if isinstance(req, dict):
        for key, name, doc, kind in (
            ("requests", "meshd_prefix_cache_requests", "Requests this device coordinated that asked the "
             "stages for a cached prefix", CounterMetricFamily),
            ("hits", "meshd_prefix_cache_hits", "... and started on one", CounterMetricFamily),
            ("reused_tokens", "meshd_prefix_cache_reused_tokens", "Prompt tokens those requests did not "
             "compute again", CounterMetricFamily),
            ("hit_rate", "meshd_prefix_cache_hit_rate", "Share of requests that started on a cached prefix",
             GaugeMetricFamily),
        ):
            if _number(req.get(key)):
                m = kind(name, doc)
                m.add_metric([], float(req[key]))
                yield m


def _exit_metrics(e: Any, label: list[str]):
    """Early exits on this stage: decode steps that could leave early, and where their tokens did."""
    if not isinstance(e, dict) or not _number(e.get("asked")):
        return
    asked = CounterMetricFamily("meshd_exit_steps", "Decode steps on this stage that asked for early exits",
                                labels=["layers"])
    asked.add_metric(label, float(e["asked"]))
    yield asked
    by_layer = e.get("by_layer")
    if isinstance(by_layer, dict):
        c = CounterMetricFamily("meshd_exit_tokens", "Tokens that left the model early, by the layers "
                                "computed before they left", labels=["layers", "exit_layer"])
        for layer, n in sorted(by_layer.items()):
            if _number(n):
                c.add_metric([*label, str(layer)], float(n))
        yield c
    if _number(e.get("rate")):
        g = GaugeMetricFamily("meshd_exit_rate", "Share of those decode steps whose token left early",
                              labels=["layers"])
        g.add_metric(label, float(e["rate"]))
        yield g


def _cloud_metrics(c: Any):
    """A paired cloud verifier, as this device's answers used it: chunks, verdicts, and the previews of
    verdicts the home pre-drafted from (how often a pre-draft was the verdict's, what it saved)."""
    t = c.get("totals") if isinstance(c, dict) else None
    if not isinstance(t, dict):
        return
    for key, name, doc in (
        ("chunks", "meshd_cloud_chunks", "Drafted chunks of cloud-verified answers"),
        ("offloaded", "meshd_cloud_offloaded_chunks", "Chunks sent to the cloud verifier"),
        ("local_fallbacks", "meshd_cloud_local_fallbacks", "Offloaded chunks committed as drafted for want "
                                                           "of a verdict"),
        ("previews", "meshd_cloud_previews", "Early verdicts (previews) received from the verifier"),
        ("predraft_rounds", "meshd_cloud_predraft_rounds", "Verification rounds in which a preview started "
                                                           "a pre-draft"),
        ("predraft_hits", "meshd_cloud_predraft_hits", "Rounds whose verdict was a pre-draft's (its drafts "
                                                       "went out at once)"),
        ("predraft_saved_s", "meshd_cloud_predraft_saved_seconds", "Drafting time the ready pre-drafts saved"),
    ):
        if _number(t.get(key)):
            m = CounterMetricFamily(name, doc)
            m.add_metric([], float(t[key]))
            yield m
    if _number(t.get("predraft_hit_rate")) and t.get("predraft_rounds"):
        g = GaugeMetricFamily("meshd_cloud_predraft_hit_rate", "Share of rounds with a pre-draft whose verdict "
                              "was a pre-draft's")
        g.add_metric([], float(t["predraft_hit_rate"]))
        yield g


def _outline_metrics(o: Any):
    """Outline decoding through this device's coordinator: answers that used it, attempts that fell
    back to a plain answer after writing an outline (time lost), requests declined before generating."""
    if not isinstance(o, dict):
        return
    if _number(o.get("used")):
        used = CounterMetricFamily("meshd_outline_used", "Requests answered in outline mode")
        used.add_metric([], float(o["used"]))
        yield used
    for key, name, doc in (
        ("fallback_reasons", "meshd_outline_fallbacks", "Outline attempts that fell back to a plain "
         "answer after writing the outline (its time lost), by reason"),
        ("declined", "meshd_outline_declined", "Requests answered plainly because outline mode was "
         "declined before generating, by reason"),
    ):
        counts = o.get(key)
        if isinstance(counts, dict):
            c = CounterMetricFamily(name, doc, labels=["reason"])
            for reason, n in sorted(counts.items()):
                if _number(n):
                    c.add_metric([str(reason)], float(n))
            yield c


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


StatusFn = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]
