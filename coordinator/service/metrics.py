"""Prometheus metrics of the coordinator, named and defined like vLLM's (prefix `wedlm:`),
served as text on an HTTP side port by prometheus-client."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("wedlm:num_requests_running", "Requests being decoded.", registry=r)
        self.waiting = Gauge("wedlm:num_requests_waiting", "Requests waiting to start.", registry=r)
        self.kv_rows = Gauge(
            "wedlm:kv_cache_usage_rows", "Committed KV rows held for running requests.", registry=r
        )
        self.in_flight = Gauge(
            "wedlm:micro_batches_in_flight", "Micro-batches in the worker pipeline.", registry=r
        )
        self.forward_shapes = Gauge(
            "wedlm:forward_shapes", "Distinct forward shapes run so far.", registry=r
        )
        self.draft_break_even = Gauge(
            "wedlm:draft_break_even",
            "A drafting forward's cost in AR forwards (speculative drafts pay above it), by rows.",
            ["rows"],
            registry=r,
        )
        self.prompt_tokens = Counter("wedlm:prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.prompt_tokens_computed = Counter(
            "wedlm:prompt_tokens_computed",
            "Prompt tokens whose KV a forward computed (not copied from a cache or a choice).",
            registry=r,
        )
        self.prompt_tokens_shared = Counter(
            "wedlm:prompt_tokens_shared",
            "Prompt tokens whose KV an n > 1 choice copied from the first choice.",
            registry=r,
        )
        self.generation_tokens = Counter(
            "wedlm:generation_tokens", "Committed generated tokens.", registry=r
        )
        self.decode_forwards = Counter(
            "wedlm:decode_forwards", "Forwards that produced tokens, per request.", registry=r
        )
        self.diffusion_canvases = Counter(
            "wedlm:diffusion_canvases", "Diffusion canvases committed.", registry=r
        )
        self.steps_per_canvas = Histogram(
            "wedlm:diffusion_forwards_per_canvas",
            "Denoising forwards per committed canvas of a diffusion request.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128),
            registry=r,
        )
        self.out_of_memory = Counter(
            "wedlm:out_of_memory", "Forwards that ran out of memory (requests requeued).",
            registry=r,
        )
        self.requests = Counter(
            "wedlm:request_success", "Finished requests.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "wedlm:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "wedlm:inter_token_latency_seconds",
            "Time between committed tokens.",
            buckets=_TOKEN_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "wedlm:time_per_output_token_seconds",
            "Decode time per output token of a request.",
            buckets=_TOKEN_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "wedlm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_time = Histogram(
            "wedlm:request_queue_time_seconds",
            "Time requests wait before running.",
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens_per_forward = Histogram(
            "wedlm:tokens_per_forward",
            "Committed tokens per forward, per finished request.",
            buckets=(0.5, 1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12, 16),
            registry=r,
        )
        self.drafted_tokens = Counter(
            "wedlm:drafted_tokens", "Draft tokens verified (speculative mode).", registry=r
        )
        self.accepted_drafts = Counter(
            "wedlm:accepted_drafts",
            "Verified draft tokens that equalled the model's choice (speculative mode).",
            registry=r,
        )
        self.accepted_per_forward = Histogram(
            "wedlm:accepted_drafts_per_forward",
            "Accepted draft tokens per forward, per finished speculative request.",
            buckets=(0, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16),
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "wedlm:prefix_cache_queries",
            "Requests started while the prefix cache was on (each looks for a cached prefix).",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "wedlm:prefix_cache_hits", "Requests that started from cached KV rows.", registry=r
        )
        self.prefix_cache_hit_tokens = Counter(
            "wedlm:prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache (not prefilled).",
            registry=r,
        )
        self.prefix_cache_evictions = Counter(
            "wedlm:prefix_cache_evictions",
            "Prefix-cache entries evicted for room (least recently used first).",
            registry=r,
        )
        self.prefix_cache_tokens = Gauge(
            "wedlm:prefix_cache_tokens", "KV rows the prefix cache holds.", registry=r
        )
        self.prefix_cache_entries = Gauge(
            "wedlm:prefix_cache_entries",
            "Finished requests whose KV rows the prefix cache keeps.",
            registry=r,
        )
        self.worker_compute = Histogram(
            "wedlm:worker_compute_seconds",
            "Layer compute time per forward on each worker.",
            ["worker"],
            buckets=_TOKEN_LATENCY,
            registry=r,
        )
        self.fetch_bytes = Counter(
            "wedlm:layer_fetch_bytes", "Layer bytes sent to workers that fetch them.", registry=r
        )
        self.fetches_active = Gauge(
            "wedlm:layer_fetches_active", "Workers fetching layers now.", registry=r
        )
        self.fetch_remaining = Gauge(
            "wedlm:layer_fetch_remaining_bytes",
            "Bytes the workers fetching now have still to receive.",
            registry=r,
        )

        self.http_requests = Counter(
            "wedlm:http_requests",
            "HTTP API requests by method, route and status.",
            ["method", "route", "status"],
            registry=r,
        )
        self.http_duration = Histogram(
            "wedlm:http_request_duration_seconds",
            "HTTP API request time (to the end of a streamed answer).",
            ["route"],
            buckets=_LATENCY,
            registry=r,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
