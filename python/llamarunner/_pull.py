"""A router's pull (``python -m llamarunner._pull NAME``, run by ``POST /api/pull`` on a
router started with ``--allow-pull``): resolves NAME (`sources`: fetching it from Hugging
Face when it is not on this machine) with Ollama's progress lines on stdout, then prints
``{"status": "success", "spec": ...}``, the model's configuration as the router takes it
(`router.model_spec`, from the router's settings read on stdin), or ``{"error": ...,
"type": ...}``."""

from __future__ import annotations

import json
import sys

from .config import ServerConfig
from .router import model_file, model_spec
from .sources import ModelSourceError, resolve_model
from .sources.progress import JsonProgress


def main(argv: list[str]) -> int:
    out = sys.stdout
    if len(argv) != 1:
        print("usage: python -m llamarunner._pull NAME < settings.json", file=sys.stderr)
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
