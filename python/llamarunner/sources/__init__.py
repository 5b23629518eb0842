"""Where models come from: a file, a models directory, Hugging Face (``huggingface``), Ollama's
store (``ollama_store``), all resolved in one place (``resolve``) into files; the library of
every model this machine holds (``library``)."""

from .errors import ModelSourceError
from .resolve import ResolvedModel, resolve_model

__all__ = ["ModelSourceError", "ResolvedModel", "resolve_model"]
