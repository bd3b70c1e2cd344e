"""Prometheus metrics, named and labelled as vLLM's (`vllm:time_to_first_token_seconds{model_name}`,
`engine` for the replica), so dashboards built for vLLM read them; what vLLM has no name for is
under `prefill:`. Request figures are observed as each request ends; the engine's (KV blocks,
requests running and waiting, rank failures, restarts) are read from every replica at scrape."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()  # one per server: tests run several in a process
        m = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two generated "
                             "tokens of a request.", m, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to "
                             "last token.", m, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Requests finished.",
                               [*m, "finished_reason"], registry=r)
        self.rejected = Counter("prefill:requests_rejected", "Requests refused before the "
                                "engine: back-pressure (429) or engine down (503).",
                                [*m, "reason"], registry=r)
        self.engine_stats: list[dict] = []  # per replica, refreshed before each scrape
        r.register(_EngineCollector(self))

    def observe(self, timing: dict, usage: dict) -> None:
        """A finished request: its `_timing` (engine_handler) and its usage."""
        label = self.model_name
        self.e2e.labels(label).observe(timing["end"] - timing["start"])
        for times in timing["token_times"]:
            if times:
                self.ttft.labels(label).observe(times[0] - timing["start"])
            for a, b in zip(times, times[1:]):
                self.itl.labels(label).observe(b - a)
        for reason in timing["finish_reasons"]:
            self.success.labels(label, reason or "abort").inc()
        self.prompt_tokens.labels(label).inc(usage["prompt_tokens"])
        self.generation_tokens.labels(label).inc(usage["completion_tokens"])

    def render(self, engine_stats: list[dict]) -> bytes:
        self.engine_stats = engine_stats
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters the replicas keep, read at scrape time."""

    GAUGES = {"vllm:num_requests_running": ("requests_running", "Requests in the engine's "
                                            "running batch."),
              "vllm:num_requests_waiting": ("requests_waiting", "Requests waiting for blocks "
                                            "or a batch slot."),
              "prefill:kv_blocks_used": ("blocks_used", "KV-cache blocks in use."),
              "prefill:kv_blocks_total": ("blocks_total", "KV-cache blocks per rank."),
              "prefill:engine_up": ("up", "1 while the replica serves, 0 while it is down or "
                                    "restarting.")}
    COUNTERS = {"vllm:prefix_cache_queries": ("prefix_lookup_tokens", "Prompt tokens looked up "
                                              "in the prefix cache."),
                "vllm:prefix_cache_hits": ("prefix_hit_tokens", "Prompt tokens served by the "
                                           "prefix cache."),
                "prefill:rank_failures": ("rank_failures", "Rank failures seen by requests."),
                "prefill:engine_restarts": ("restarts", "Restarts of the replica's rank groups.")}

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        stats, name = self.metrics.engine_stats, self.metrics.model_name
        labels = ["model_name", "engine"]
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks "
                                  "in use (0-1).", labels=labels)
        for i, s in enumerate(stats):
            usage.add_metric([name, str(i)], s["blocks_used"] / max(1, s["blocks_total"]))
        yield usage
        for metric, (key, doc) in self.GAUGES.items():
            family = GaugeMetricFamily(metric, doc, labels=labels)
            for i, s in enumerate(stats):
                family.add_metric([name, str(i)], s[key])
            yield family
        for metric, (key, doc) in self.COUNTERS.items():
            family = CounterMetricFamily(metric, doc, labels=labels)
            for i, s in enumerate(stats):
                family.add_metric([name, str(i)], s[key])
            yield family
