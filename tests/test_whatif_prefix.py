"""With `prefixes_as_counted` (`pdproxy whatif --prefixes-as-counted`), a shared prefix is replayed at the size the
server counted, not the size its draw asked for. The default of `pdproxy whatif` since issue 56 (docs/explanation/whatif.md, "Input"); docs/notes/whatif-issue40.md, "Spread".

Run A (tests/fixtures/real-xpyd-2026-12-01b) was recorded by a bench that asked for the agent class's own 900
tokens only and sized the five system prompts in words: vLLM counted 2,085-3,114 prompt tokens, one count per
system prompt, where the draws say 517-897 prefix tokens. vLLM's spans of the singles run agree with the
server's count: scheduled to first token 94 ms (median), one prefill step of ~900 new tokens on the shared
GPU, not ~2,200.
"""

from __future__ import annotations

import gzip
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from pdproxy.bench import traces
from pdproxy.sim.engine import Sequence
from pdproxy.sim.presets import PRESETS
from pdproxy.whatif import model, setups, workload

A = Path(__file__).parent / "fixtures" / "real-xpyd-2026-12-01b"
DP = A / "bench-dp-cc978f0c.jsonl.gz"
OWN = 900  # the agent class's own prompt tokens, as the run header asks for them


def _agents(wl: workload.Workload) -> list[workload.Request]:
    return [r for c in wl.classes if c.name == "agent" for r in c.requests]


def test_a_prefix_sized_in_words_is_replayed_at_the_servers_count():
    agents = _agents(workload.from_bench(DP, prefixes_as_counted=True))
    assert len(agents) > 100
    for r in agents:
        assert r.prefix is not None
        own = r.prompt_tokens - r.prefix_tokens
        assert own == OWN, (r.request_id, r.prompt_tokens, r.prefix_tokens)  # main: 1,568-2,406 own tokens
    # one size per system prompt, as the server counted them
    sizes: dict[int | None, set[int]] = {}
    for r in agents:
        sizes.setdefault(r.prefix, set()).add(r.prefix_tokens)
    assert len(sizes) == 5 and all(len(s) == 1 for s in sizes.values()), sizes


def test_the_workload_reads_a_prefix_as_its_draw_unless_asked():
    """`workload.from_bench` keeps the draw unless asked (`pdproxy whatif` asks by default: docs/notes/whatif-issue40.md, "Spread")."""
    agents = _agents(workload.from_bench(DP))
    assert len(agents) > 100
    assert all(500 < r.prefix_tokens < 900 for r in agents), {r.prefix_tokens for r in agents}


def test_the_command_replays_the_servers_count_by_default_and_says_so():
    def run(*extra: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "pdproxy", "whatif", "--records", str(DP), "--num-gpu-blocks", "4096",
                            "--preset", "h200-llama8b",
                            "--setup", "4xsingle", "--no-fit-run", "--no-table", "--json", "-", *extra],
                           capture_output=True, text=True, timeout=150,
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parent.parent)})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    drawn, counted = run("--no-prefixes-as-counted"), run()
    note = [n for n in counted["whatif"]["workload"]["notes"] if "--prefixes-as-counted" in n]
    assert note and int(note[0].split()[0]) > 100, note
    assert not any("--prefixes-as-counted" in n for n in drawn["whatif"]["workload"]["notes"])
    # the cached system prompt is the server's: ~900 new tokens to prefill per agent prompt instead of ~2,200, so the
    # four singles serve more requests in the same time (at the preset's sharing: 531 against 478)
    assert counted["runs"][0]["stats"]["requests"]["ok"] > 1.05 * drawn["runs"][0]["stats"]["requests"]["ok"]


def test_a_record_that_asked_for_the_prefix_keeps_its_draw(tmp_path):
    """The bench now asks for the prefix's tokens too: what the server counted beyond it is not the prefix's."""
    with gzip.open(DP, "rt") as f:
        lines = [json.loads(line) for line in f]
    for x in lines:
        if x.get("type") == "request" and x.get("prompt_tokens"):
            x["prompt_tokens_requested"] = x["prompt_tokens"] - 2  # a lead token or two off, as a tokenizer may be
    path = tmp_path / "asked.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    drawn = {r.request_id: r.prefix_tokens for r in _agents(workload.from_bench(path, prefixes_as_counted=True))}
    assert drawn and max(drawn.values()) < 1000, drawn  # the draws (517-897), not the server's 2 extra tokens
    assert all(n > 500 for n in drawn.values()), drawn


def test_a_replayed_agent_prompt_prefills_as_long_as_vllm_took(monkeypatch):
    """The singles' own GPU sharing (1.0, what --fit-run gives them) and the prompts at the server's size: the
    model's median time from scheduled to first token lands near vLLM's (main: twice as long)."""
    spans = traces.read_traces([str(A / "vllm-spans.otlp.jsonl.gz")])
    recorded = statistics.median(i.engine["prefill"].prefill for i in spans.by_request.values()
                                 if "cc978f0c-agent" in i.request_id and "prefill" in i.engine)
    seqs: dict[str, Sequence] = {}
    generate = model._Instance.generate

    async def keep(self, request_id, *args, **kwargs):  # type: ignore[no-untyped-def]
        seq, frontend = await generate(self, request_id, *args, **kwargs)
        seqs[request_id] = seq
        return seq, frontend

    monkeypatch.setattr(model._Instance, "generate", keep)
    wl = workload.from_bench(DP, prefixes_as_counted=True)
    preset = replace(PRESETS["h200-llama8b"], max_model_len=8192, num_gpu_blocks=4096, gpu_share=1.0)
    outs = model.simulate(wl, setups.parse_setup("4xsingle"), model.ModelParams(preset))
    agents = [seqs[f"{o.request.request_id}-d1"] for o in outs
              if o.request.cls == "agent" and o.error is None and o.start >= wl.warmup_seconds]
    assert len(agents) > 100
    modelled = statistics.median(s.first_token_at - s.scheduled_at for s in agents)  # type: ignore[operator]
    assert 0.6 * recorded < modelled < 1.3 * recorded, (modelled, recorded)  # main: 207 ms against 102
