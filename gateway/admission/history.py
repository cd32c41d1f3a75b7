"""Recent output length per tenant, for predicting how long a request will decode."""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_MAX_TENANTS = 10_000


class OutputHistory:
    """Exponentially weighted mean of completion tokens per tenant, LRU-bounded."""

    def __init__(self, *, alpha: float = 0.2, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self._alpha = alpha
        self._max = max_tenants
        self._means: OrderedDict[str, float] = OrderedDict()

    def record(self, tenant: str | None, completion_tokens: int) -> None:
        if tenant is None or completion_tokens < 0:
            return
        old = self._means.pop(tenant, None)
        new = (
            float(completion_tokens)
            if old is None
            else old + self._alpha * (completion_tokens - old)
        )
        self._means[tenant] = new
        if len(self._means) > self._max:
            self._means.popitem(last=False)

    def average(self, tenant: str | None) -> float | None:
        if tenant is None:
            return None
        return self._means.get(tenant)

    def __len__(self) -> int:
        return len(self._means)
