"""Prometheus metrics under the names vLLM and llama-server share (prefix `specdecode:`), and the
per-request speculative counts (vLLM's `metrics.speculative_decoding`).

The registry is the server's own, not the process-wide default, so that two servers in one
process (the tests) count apart. prometheus-client appends `_total` to a counter's name itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "specdecode:"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5)


@dataclass
class RequestSpec:
    """What speculation did for one request, from its rows' updates (all choices together)."""

    spec_steps: int = 0  # rounds in which the row had tokens drafted
    draft_tokens: int = 0
    accepted_tokens: int = 0
    histogram: list[int] = field(default_factory=list)  # [i]: rounds that accepted i drafted

    def add(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.spec_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.histogram) <= accepted:
            self.histogram.extend([0] * (accepted + 1 - len(self.histogram)))
        self.histogram[accepted] += 1

    @classmethod
    def total(cls, specs: list[RequestSpec]) -> RequestSpec:
        """The counts of several rows together (a request with several prompts)."""
        out = cls()
        for spec in specs:
            out.spec_steps += spec.spec_steps
            out.draft_tokens += spec.draft_tokens
            out.accepted_tokens += spec.accepted_tokens
            for i, count in enumerate(spec.histogram):
                if len(out.histogram) <= i:
                    out.histogram.append(0)
                out.histogram[i] += count
        return out

    def as_dict(self) -> dict[str, Any]:
        steps, drafted = self.spec_steps, self.draft_tokens
        return {
            "num_spec_steps": steps,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": self.accepted_tokens,
            # tokens a drafting round commits on average: its accepted ones plus the target's
            "mean_acceptance_length": 1 + self.accepted_tokens / steps if steps else None,
            "draft_acceptance_rate": self.accepted_tokens / drafted if drafted else None,
            "acceptance_histogram": list(self.histogram),
        }


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name.removesuffix("_total"), doc, labels, registry=r)

        self.num_drafts = counter("spec_decode_num_drafts_total", "Rounds that drafted for a row")
        self.num_draft_tokens = counter(
            "spec_decode_num_draft_tokens_total", "Tokens drafted for rows"
        )
        self.num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens_total", "Drafted tokens the target accepted"
        )
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "Drafted tokens accepted at each draft position (0 = the first drafted token)",
            ("position",),
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished requests")
        self.generation_tokens = counter(
            "generation_tokens_total", "Completion tokens of finished requests"
        )
        self.prefix_reused_tokens = counter(
            "prefix_cache_reused_tokens_total", "Prompt tokens served from a cached prefix"
        )
        self.requests_success = counter(
            "request_success_total", "Finished requests by reason", ("finished_reason",)
        )
        self.running = Gauge(PREFIX + "num_requests_running", "Rows in the batch", registry=r)
        self.waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting for a row", registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From arrival to the first committed token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "After the first token, seconds per further token",
            buckets=TOKEN_TIME_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From arrival to the last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def add_round(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(drafted)
        self.num_accepted_tokens.inc(accepted)
        for position in range(accepted):  # acceptance is a prefix of the drafted tokens
            self.accepted_per_pos.labels(position=str(position)).inc()

    def answered(self) -> int:
        """Requests finished, whatever their reason (the sum over `request_success_total`)."""
        return int(
            sum(
                sample.value
                for family in self.requests_success.collect()
                for sample in family.samples
                if sample.name.endswith("_total")
            )
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
