"""The router's settings, validated once at construction and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.contract.lora import name_problem


@dataclass(frozen=True)
class RoutingConfig:
    # Bounded load (as KubeAI's CHWBL): no replica takes a request that would put its in-flight
    # count above load_factor x the mean (the new request included).
    load_factor: float = 1.25
    # Score weights: prefix match (fraction of the prompt's blocks held) against queue (in-flight
    # and waiting, relative to the busiest candidate) and KV-cache utilization.
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    # A request for a LoRA adapter: what a replica scores for having it resident in one of its
    # --max-loras slots (it serves at once), or for a free slot to load it into (no other
    # adapter is evicted); one that would have to evict another scores neither. Each step is
    # worth more than a whole prefix match (prefix_weight), so at equal load residency comes
    # first, then prefix, then load; the queue and KV terms (up to queue_weight + kv_weight)
    # overturn one step only between a saturated replica and an idle one, and the bound spreads
    # a hot adapter before that.
    lora_resident_weight: float = 7.0
    lora_free_slot_weight: float = 3.5
    # Requests above the bound a replica may take for an adapter it can serve without an
    # eviction, where each replica within the bound would have to evict one.
    lora_slack: int = 4

    def __post_init__(self) -> None:
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        weights = (
            self.prefix_weight,
            self.queue_weight,
            self.kv_weight,
            self.lora_resident_weight,
            self.lora_free_slot_weight,
        )
        if min(weights) < 0:
            raise ValueError("routing weights must be >= 0")
        if self.lora_slack < 0:
            raise ValueError(f"lora_slack must be >= 0, got {self.lora_slack}")
        if self.lora_free_slot_weight > self.lora_resident_weight:
            raise ValueError("lora_free_slot_weight must not exceed lora_resident_weight")


@dataclass(frozen=True)
class HoldConfig:
    """Requests for a model with no Ready replica wait here (scale from zero, restarts)."""

    max_held_per_model: int = 256
    # Sized for a slow model load: an image pull plus weights can take minutes.
    timeout_s: float = 300.0
    retry_after_s: int = 30

    def __post_init__(self) -> None:
        if self.max_held_per_model < 0:
            raise ValueError("max_held_per_model must be >= 0")
        if self.timeout_s <= 0:
            raise ValueError("the hold timeout must be > 0")


DEFAULT_REPLICA_CONCURRENCY = 32


@dataclass(frozen=True)
class TenancyConfig:
    """Tenants (Tenant objects and their key Secrets in the watched namespaces, or a file):
    every request needs a tenant's key, is checked against its grants and quotas, and waits in
    its model's fair queue while the replicas are saturated."""

    # Shared quota counters for several routers (redis://...); None: this router counts alone.
    quota_store_url: str | None = None
    # Tenant and Secret manifests (YAML), reloaded when the file changes: tenants without
    # Kubernetes (development, benchmarks).
    tenants_file: str | None = None
    # A replica is saturated for a priority class when this many requests of that class or a
    # better one are in flight there from this router. None: the engine's own max_num_seqs (from
    # its load reports), or DEFAULT_REPLICA_CONCURRENCY from an engine that does not say.
    replica_concurrency: int | None = None
    max_queued_per_model: int = 1024
    queue_timeout_s: float = 120.0
    # The fair queue's cost of a request without max_tokens (settled with its real tokens).
    default_completion_estimate: int = 256
    # Completion tokens charged to the quota while a stream goes, at most this many at once.
    charge_every_tokens: int = 32
    # How often routers write each active tenant's window use to its status.
    status_interval_s: float = 10.0
    # For this long after this router admitted a request of a priority class on a model, that
    # model's requests of worse classes declare the class to the engine
    # (kvpilot_guard_priority): its guard then bounds their share of each step before the
    # better class's next request arrives, not from the step after it. 0: never declared.
    guard_memory_s: float = 60.0

    def __post_init__(self) -> None:
        if self.replica_concurrency is not None and self.replica_concurrency < 1:
            raise ValueError("replica_concurrency must be >= 1")
        if self.max_queued_per_model < 0:
            raise ValueError("max_queued_per_model must be >= 0")
        if self.queue_timeout_s <= 0:
            raise ValueError("the queue timeout must be > 0")
        if self.charge_every_tokens < 1:
            raise ValueError("charge_every_tokens must be >= 1")
        if self.guard_memory_s < 0:
            raise ValueError("guard_memory_s must be >= 0")


@dataclass(frozen=True)
class RouterConfig:
    namespaces: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8080
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    hold: HoldConfig = field(default_factory=HoldConfig)
    # A replica whose event stream has been silent this long is out of rotation (it heartbeats
    # every 0.5 s).
    dead_after_s: float = 2.0
    # The index keeps at most this many block hashes per replica (an engine never holds more
    # than its pool; this bounds a misbehaving one).
    max_blocks_per_replica: int = 1 << 20
    # Requests a failed upstream may be retried on another replica (only before any byte left).
    max_attempts: int = 3
    max_body_bytes: int = 32 << 20
    # The engines' key where an InferenceService names no Secret for it (static backends).
    engine_api_key: str | None = None
    # How often the Secrets named by spec.engine.apiKeySecret are read again (a rotated key is
    # also read at once after a replica answers 401).
    engine_key_refresh_s: float = 5.0
    # Who asks the operator to wake a model (recorded on the InferenceService).
    router_name: str = "kvpilot-router"
    # Without Kubernetes (development, benchmarks): model -> replica URLs, fixed.
    static_models: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # ... and the LoRA adapters each of those models' engines serves: model -> adapter names.
    static_adapters: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # ... and the prefixes each shares across tenants: model -> texts.
    static_shared_prefixes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # None: no tenants (any client of the router may use every model).
    tenancy: TenancyConfig | None = None

    def __post_init__(self) -> None:
        if not self.namespaces and not self.static_models:
            raise ValueError("the router needs a namespace to watch (or static models)")
        if self.dead_after_s <= 0:
            raise ValueError("dead_after_s must be > 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.engine_key_refresh_s <= 0:
            raise ValueError("engine_key_refresh_s must be > 0")
        static = {model for model, _ in self.static_models}
        for model, names in self.static_adapters:
            if model not in static:
                raise ValueError(f"adapters of {model!r}, which is not a static model")
            for name in names:
                problem = name_problem(name)
                if problem:
                    raise ValueError(problem)
