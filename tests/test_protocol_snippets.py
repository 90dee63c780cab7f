"""The Python snippets of docs/protocol.md section 3 (gate parameters) run as written: the one that
writes a --weights file makes what the server loads, the one that draws the seeded gates gives
what a server of that seed serves."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import torch

from gdn_server.config import PRESETS
from gdn_server.weights import load_gate_params, random_gate_params

PROTOCOL_DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def _section_3_snippets() -> list[str]:
    text = PROTOCOL_DOC.read_text()
    section = text[text.index("\n## 3. "):text.index("\n## 4. ")]
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```$", section, re.S | re.M)
    return [textwrap.dedent(body) for _, body in blocks]


def test_the_gate_snippets_run_and_give_what_the_server_uses(tmp_path, monkeypatch, capsys):
    write, seeded = _section_3_snippets()
    monkeypatch.chdir(tmp_path)
    exec(compile(write, "protocol.md: gates file", "exec"), {})
    gates = load_gate_params(tmp_path / "gates.safetensors", num_v_heads=2)  # as gdn-server --weights reads it
    assert gates.A_log.tolist() == [[0.0, 0.5]] and gates.dt_bias.tolist() == [[0.25, -1.0]]
    names: dict = {}
    exec(compile(seeded, "protocol.md: seeded gates", "exec"), names)
    assert torch.equal(names["gates"].A_log, random_gate_params(PRESETS["qwen3-next"], 0).A_log)
    assert names["gates"].A_log.shape == (36, 32) and names["small"].dt_bias.shape == (2, 4)
    assert "torch.Size([36, 32])" in capsys.readouterr().out
