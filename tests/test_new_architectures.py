"""An architecture that llama.cpp learned after llama-cpp-sys-2 0.1.154 loads and generates.

``spark2_5`` is new in the llama.cpp of llama-cpp-sys-2 0.1.161 (``src/models/spark2-5.cpp``);
tinymodel.py's ``write_spark2_5_model`` says what its tiny model holds. The llama.cpp of 0.1.154
refuses the file ("unknown model architecture: 'spark2_5'"), so this test fails there at the
model load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx

from llamarunner import Server

from helpers import complete
from tinymodel import N_LAYER, SPARK2_5, write_spark2_5_model


def test_spark2_5_loads_and_completes(tmp_path: Path, start_server: Callable[..., Server]) -> None:
    model = write_spark2_5_model(tmp_path / "tiny-spark2_5.gguf")
    srv = start_server(model, parallel=1, ctx_size=512)
    props = httpx.get(f"{srv.url}/props", timeout=30)
    assert props.status_code == 200, props.text
    model_props = props.json()["model"]
    assert model_props["architecture"] == SPARK2_5
    assert model_props["n_layer"] == N_LAYER
    # `complete` streams /completion and checks its status is 200 and that it ends without error.
    text, final = complete(srv.url, "hello world", num_predict=8, temperature=0, ignore_eos=True)
    assert isinstance(text, str)
    assert (final["done_reason"], final["eval_count"]) == ("length", 8), final
    assert final["prompt_eval_count"] >= 3  # BOS + tokens of "hello world"
