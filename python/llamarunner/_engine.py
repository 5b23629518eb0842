"""One model's engine process under a model router (``python -m llamarunner._engine``): it
serves the model on the loopback port its configuration names, and ends when the model fails
or its engine stops (the router sees the exit and reports it), when it is told to (SIGTERM,
SIGKILL), or when the router is gone."""

from __future__ import annotations

import os
import signal
import sys

from . import _core, _gpu_modules
from ._health import Health, watch_serving

CONFIG_ENV = "LLAMARUNNER_ENGINE_CONFIG"


def main() -> int:
    config = os.environ.pop(CONFIG_ENV, None)
    name = os.environ.get("LLAMARUNNER_ENGINE_NAME", "?")
    if config is None:
        print(f"llamarunner: {CONFIG_ENV} is not set: this runs under a router", file=sys.stderr)
        return 2
    parent = os.getppid()
    try:
        _gpu_modules.prepare()
        native = _core.start(config)
    except (ValueError, OSError, _core.ModelLoadError) as e:
        print(f"llamarunner: model {name}: {e}", file=sys.stderr, flush=True)
        return 1

    def on_sigterm(signum: int, frame: object) -> None:
        native.stop()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    # Until the engine dies, or the router is gone.
    died = watch_serving(
        lambda: Health(*native.health()), 0.2, until=lambda: os.getppid() != parent
    )
    if died is not None:
        # Said first: the router reads it even if stopping the engine then hangs.
        print(f"llamarunner: model {name}: {died.error}", file=sys.stderr, flush=True)
    native.stop()
    return 0 if died is None else 1


if __name__ == "__main__":
    sys.exit(main())
