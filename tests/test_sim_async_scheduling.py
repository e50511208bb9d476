"""vLLM's async scheduling in the simulated engine (preset `async_scheduling`, on in the h200 presets).

vLLM's engine core schedules step k+1 while step k runs (vllm/v1/engine/core.py `step_with_batch_queue`), so a
prompt that arrives while a step runs misses the step already scheduled: one step more to its first token beside
running streams, none on an idle engine. The recorded vLLM 0.23 singles show it (tests/fixtures/vllm023,
`llm_request` spans: a cached prompt's scheduled-to-first-token is 9.1-9.8 ms at p10 beside running streams, two
decode steps). Checked on the engine in virtual time, where a step's length is the preset's exactly.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from pdproxy.sim.engine import Engine, Sequence
from pdproxy.sim.presets import H200_LLAMA8B
from pdproxy.sim.settings import SimSettings
from pdproxy.whatif import virtual

PROMPT = 128


def _first_token(async_scheduling: bool, busy: bool) -> tuple[float, float]:
    """Seconds from a prompt's submission to its first token, and one decode step of the running stream."""
    preset = replace(H200_LLAMA8B, async_scheduling=async_scheduling)

    async def main(clock: virtual.VirtualClock) -> tuple[float, float]:
        engine = Engine(SimSettings(role="single", preset=preset), virtual.NullMetrics(), clock,  # type: ignore[arg-type]
                        None)
        loop = asyncio.ensure_future(engine.run())
        step = engine.cost.step_seconds(1, 0)
        if busy:
            engine.submit(Sequence("stream", PROMPT, 1000, "length", clock.now()))
            await clock.sleep(20 * step + step / 2)  # mid-step of a stream that decodes
        seq = Sequence("new", PROMPT, 2, "length", clock.now())
        engine.submit(seq)
        waiter = seq.wait(1)
        assert waiter is not None
        await waiter
        assert seq.first_token_at is not None
        loop.cancel()
        return seq.first_token_at - seq.arrival, step

    return virtual.run(main)


def test_a_prompt_beside_running_streams_misses_the_step_already_scheduled():
    sync, step = _first_token(False, busy=True)
    lookahead, _ = _first_token(True, busy=True)
    # the rest of the running step, then (async) the step scheduled while it ran, then its own
    assert lookahead - sync == pytest.approx(step, rel=0.05)


def test_an_idle_engine_schedules_a_prompt_at_once():
    sync, _ = _first_token(False, busy=False)
    lookahead, _ = _first_token(True, busy=False)
    assert lookahead == pytest.approx(sync)


@pytest.mark.parametrize("flag, expected", [([], False), (["--async-scheduling"], True),
                                            (["--async-scheduling", "--no-async-scheduling"], None)])
def test_pdproxy_sim_takes_vllms_flag(flag, expected):
    from pdproxy.cli import build_parser
    from pdproxy.sim.cli import settings_from_args

    argv = ["sim", "--role", "single", *flag]
    if expected is None:  # the two are exclusive, as vLLM's own pair
        with pytest.raises(SystemExit):
            build_parser(argv).parse_args(argv)
        return
    assert settings_from_args(build_parser(argv).parse_args(argv)).preset.async_scheduling is expected
