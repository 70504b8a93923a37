"""Tenant quotas: requests and tokens per minute and requests in flight, per tenant and per
tenant x model, counted in Redis shared by every router (or in one router alone), with a
per-tenant choice of what happens while the store is unreachable.

The router builds the request's Scopes, calls QuotaKeeper.admit, answers a refusal with 429
(503 for `store_unavailable`) and the decision's headers, charges completion tokens as they
stream and settles once at the end.
"""

from __future__ import annotations

from kvpilot.router.quota.decision import Decision
from kvpilot.router.quota.keeper import QuotaKeeper
from kvpilot.router.quota.local_store import LocalQuotaStore
from kvpilot.router.quota.model import Lease, Scope, Usage, model_scope_key, tenant_scope_key
from kvpilot.router.quota.redis_store import RedisQuotaStore

__all__ = [
    "Decision",
    "Lease",
    "LocalQuotaStore",
    "QuotaKeeper",
    "RedisQuotaStore",
    "Scope",
    "Usage",
    "model_scope_key",
    "tenant_scope_key",
]
