"""Profile the server under the parallel-8 load with perf (cpu-clock sampling).

python -m benches.profile && perf report -i /tmp/perf.data --no-children --sort symbol
"""

import random
import subprocess
import threading
import time

from benches import load
from llamarunner import default_model_path


def main() -> None:
    m = str(default_model_path())
    plan = load.Plan(m, 2, 3, random.Random(3))
    with load.ours(m, 8, 2048, 2) as srv:
        t = threading.Thread(target=lambda: load.run_clients(srv, load.distinct(plan, 8, 178), 64))
        t.start()
        time.sleep(1)
        subprocess.run(
            [
                "perf",
                "record",
                "-F",
                "499",
                "-e",
                "cpu-clock",
                "-g",
                "-o",
                "/tmp/perf.data",
                "-p",
                str(srv.proc.pid),
                "--",
                "sleep",
                "15",
            ],
            capture_output=True,
        )
        t.join()


if __name__ == "__main__":
    main()
