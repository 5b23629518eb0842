"""`Client` and `AsyncClient` are twins: what each call sends and how its answer is read is
written once (`llamarunner._requests`), and the two classes only send, wait and iterate. The
typed signatures are written in both (a type checker cannot say "this method, sync or async");
this test keeps them the same, so that neither can drift from the other."""

from __future__ import annotations

import inspect

from llamarunner import AsyncClient, Client

# The async spelling of a sync name.
_ASYNC_NAMES = {"close": "aclose"}


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


def _as_sync(annotation: object) -> object:
    """An async method's annotation as the sync twin writes it."""
    return (
        annotation.replace("AsyncStream", "Stream") if isinstance(annotation, str) else annotation
    )


def test_the_two_clients_have_the_same_methods_and_signatures() -> None:
    sync, async_ = _public(Client), _public(AsyncClient)
    assert {_ASYNC_NAMES.get(n, n) for n in sync} == set(async_)
    for name, signature in sync.items():
        twin_name = _ASYNC_NAMES.get(name, name)
        assert inspect.iscoroutinefunction(getattr(AsyncClient, twin_name)), twin_name
        twin = async_[twin_name]
        assert _as_sync(twin.return_annotation) == signature.return_annotation, name
        assert [
            (p.name, p.kind, p.default, _as_sync(p.annotation)) for p in twin.parameters.values()
        ] == [(p.name, p.kind, p.default, p.annotation) for p in signature.parameters.values()], (
            name
        )
    init, twin_init = inspect.signature(Client), inspect.signature(AsyncClient)
    assert [p.name for p in init.parameters.values()] == [
        p.name for p in twin_init.parameters.values()
    ]
