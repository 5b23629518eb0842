"""The error every model source raises: a message a user can act on, and a machine-readable
kind (what the CLI prints, what ``/api/pull`` streams, what a test checks)."""

from __future__ import annotations


class ModelSourceError(Exception):
    """A model could not be found, fetched or read. ``kind`` is one of: ``not_found`` (no
    source has it), ``no_file`` (the repository has no GGUF, or none for the tag),
    ``unauthorized`` (gated or private: a token is needed), ``offline`` (not cached, and
    downloads are off), ``network`` (the hub could not be reached), ``disk_full``,
    ``hash_mismatch``, ``io`` (the cache cannot be written or read), ``bad_manifest`` (an
    Ollama manifest or blob that cannot be used), ``bad_name`` (a name no source takes),
    ``not_ours`` (``rm`` of a model we did not download)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def exit_code(self) -> int:
        """The CLI's exit status: 2 for what the argument names (or does not), as for a bad
        flag; 1 for a failure on the way (the network, the disk, a bad download)."""
        failures = ("network", "disk_full", "hash_mismatch", "unauthorized", "io")
        return 1 if self.kind in failures else 2
