"""The exceptions `Client` and `AsyncClient` raise, and which status code raises which."""

from __future__ import annotations


class LlamaRunnerError(Exception):
    """Base of every error this client raises."""


class APIConnectionError(LlamaRunnerError):
    """The server could not be reached."""


class APITimeoutError(APIConnectionError):
    """The request timed out."""


class APIStatusError(LlamaRunnerError):
    """The server answered with an error status (or an error inside a stream)."""

    def __init__(self, message: str, *, status_code: int, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type

    def __str__(self) -> str:
        return f"{self.status_code} {self.type or 'error'}: {self.message}"


class BadRequestError(APIStatusError):
    """400: the request is invalid."""


class AuthenticationError(APIStatusError):
    """401: the server requires an API key and none, or a wrong one, was sent."""


class PermissionDeniedError(APIStatusError):
    """403: refused whatever the key (a foreign ``Host`` or ``Origin`` header)."""


class NotFoundError(APIStatusError):
    """404: no such endpoint."""


class PayloadTooLargeError(APIStatusError):
    """413: the request body is larger than the server's ``--max-body``."""


class RateLimitError(APIStatusError):
    """429: too many requests are waiting for a slot."""


class ServiceUnavailableError(APIStatusError):
    """503: the model is loading or the server is stopping."""


STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    413: PayloadTooLargeError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}
"""The `APIStatusError` subclass an error status raises; other statuses raise the base."""
