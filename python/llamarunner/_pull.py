"""A router's pull (``python -m llamarunner._pull NAME``, run by ``POST /api/pull`` on a
router started with ``--allow-pull``): resolves NAME (`sources`: fetching it from Hugging
Face when it is not on this machine) with Ollama's progress lines on stdout, then prints
``{"status": "success", "spec": ...}``, the model's configuration as the router takes it
(`router.model_spec`, from the router's settings read on stdin), or ``{"error": ...,
"type": ...}``. ``--delete NAME`` (``DELETE /api/delete``) removes a model from the Hugging
Face cache (`sources.library.remove`: never Ollama's store or a file)."""

from __future__ import annotations

import json
import sys

from .config import ServerConfig
from .router import model_file, model_spec
from .sources import ModelSourceError, resolve_model
from .sources.library import remove
from .sources.progress import JsonProgress


def delete(name: str) -> int:
    """``--delete NAME``: removes the model from the Hugging Face cache (`library.remove`)."""
    try:
        remove(name)
    except ModelSourceError as e:
        sys.stdout.write(json.dumps({"error": str(e), "type": e.kind}) + "\n")
        return e.exit_code
    sys.stdout.write(json.dumps({"status": "success"}) + "\n")
    return 0


def main(argv: list[str]) -> int:
    out = sys.stdout
    if len(argv) == 2 and argv[0] == "--delete":
        return delete(argv[1])
    if len(argv) != 1:
        print(
            "usage: python -m llamarunner._pull NAME < settings.json, or --delete NAME",
            file=sys.stderr,
        )
        return 2
    try:
        given = json.loads(sys.stdin.read())
        base = ServerConfig(**given["base"])
        models_max = int(given["models_max"])
        offline, mmproj = bool(given.get("offline")), bool(given.get("mmproj", True))
    except (ValueError, KeyError, TypeError) as e:
        out.write(json.dumps({"error": f"bad pull settings: {e}", "type": "pull_failed"}) + "\n")
        return 2
    try:
        # A client names what to pull: never a file of this machine.
        resolved = resolve_model(
            argv[0], offline=offline, mmproj=mmproj, files=False, progress=JsonProgress(out)
        )
    except ModelSourceError as e:
        out.write(json.dumps({"error": str(e), "type": e.kind}) + "\n")
        return e.exit_code
    spec = model_spec(base, model_file(resolved), models_max)
    out.write(json.dumps({"status": "success", "spec": spec}) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
