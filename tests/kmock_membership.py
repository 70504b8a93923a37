"""kmock answers "does this reaction's view hold the request just received?" for every reaction on
every request by iterating the whole request history through the view's filters: quadratic in the
requests a test makes, most of an operator test's time once it has made a few thousand. For the
views that a chain of criteria filters and priorities over the server's own request list is made of
(every reaction KubernetesEmulator declares for itself, and most of those a test declares), the same
answer comes from the request alone: it is in the list (it was recorded before it is served) and
passes each filter's criteria. Other views (slices, groups, exclusions) keep kmock's own check."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def fast_contains(original: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    from kmock._internal import dsl, rendering

    def contains(view: Any, item: Any) -> bool:
        if isinstance(item, rendering.Request):
            source = view
            while True:
                kind = type(source)
                if kind is dsl.Filter:
                    if not source.criteria(item):
                        return False
                    source = source._source
                elif kind is dsl.Priority:
                    source = source._source
                elif isinstance(source, dsl.Root) and kind.__iter__ is dsl.Root.__iter__:
                    # Root's own iteration: its recorded requests (by identity, as kmock checks).
                    return any(request is item for request in reversed(source._requests))
                else:
                    break
        return original(view, item)

    return contains


@contextmanager
def fast_request_membership() -> Iterator[None]:
    """Within: kmock's views check a request's membership as above."""
    try:
        from kmock._internal import dsl
    except ImportError:  # kmock is a dev dependency: nothing to speed up without it
        yield
        return
    original = dsl.View.__contains__
    dsl.View.__contains__ = fast_contains(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        dsl.View.__contains__ = original  # type: ignore[method-assign]
