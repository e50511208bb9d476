"""precise_prefix's choice from per-instance event indexes: longest held prefix, load, fallback, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from pdproxy import policies
from pdproxy.blocks import chain_hashes
from pdproxy.kvevents import BlockIndex, BlockStored
from pdproxy.policies.request import RequestView
from pdproxy.routing.tokens import LocalTokenizer, given


@dataclass(eq=False)
class Inst:
    address: str
    inflight: int = 0

    @property
    def url(self) -> str:
        return "http://" + self.address


@dataclass
class Sub:
    index: BlockIndex = field(default_factory=BlockIndex)
    flowing: bool = True


class Events:
    def __init__(self, names):
        self.subs = {n: Sub() for n in names}

    def get(self, address):
        return self.subs.get(address)


def store(sub: Sub, tokens: list[int]) -> None:
    n = len(tokens) // 16
    sub.index.apply(BlockStored([hash(("engine", k, tokens[0])) for k in range(n)], None, tokens[:16 * n], 16))


def ids(prompt: list[int]) -> RequestView:
    """A token-id prompt's view, its ids taken as the router takes them before a policy chooses."""
    view = RequestView({"prompt": prompt})
    assert given(view)
    return view


def test_longest_held_prefix_wins_then_load_then_fallback(tmp_path):
    a, b = Inst("a:1"), Inst("b:1")
    policy = policies.create("precise_prefix")
    events = Events(["a:1", "b:1"])
    policy.use_events(events)
    prompt = list(range(1, 200))
    store(events.subs["a:1"], prompt[:64])  # a holds 4 blocks
    store(events.subs["b:1"], prompt[:128])  # b holds 8
    chosen, decision = policy.choose([a, b], ids(prompt))
    assert chosen is b and (decision.reason, decision.matched, decision.unit) == ("prefix_match", 128, "tokens")
    assert decision.scores() == {"a:1": 64.0, "b:1": 128.0}
    # nobody holds it: the least loaded
    b.inflight = 3
    chosen, decision = policy.choose([a, b], ids([7] * 100))
    assert chosen is a and decision.reason == "cache_miss"
    # far more load on the holder: balanced
    b.inflight = 200
    chosen, decision = policy.choose([a, b], ids(prompt))
    assert chosen is a and decision.reason == "imbalanced"
    # b's events stop flowing: the approximate index, which learnt the earlier choices
    b.inflight = 0
    events.subs["b:1"].flowing = False
    chosen, decision = policy.choose([a, b], ids(prompt))
    assert decision.reason == "approximate" and decision.fallback == "events_not_flowing"
    assert policy.fallbacks == {"b:1": 1}  # counted at the instance whose events stopped
    assert decision.matched and decision.unit == "tokens"  # the approximate index learnt where this prompt went
    # chat has no token ids here: approximate
    events.subs["b:1"].flowing = True
    chosen, decision = policy.choose([a, b], RequestView({"messages": [{"role": "user", "content": "hi"}]}, chat=True))
    assert (decision.reason, decision.fallback, decision.fallback_at) == ("approximate", "no_token_ids", [chosen.address])


def test_text_prompts_through_a_local_tokenizer_file(tmp_path):
    words = [f"w{k}" for k in range(400)]
    tok = Tokenizer(WordLevel({w: k for k, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    policy = policies.create("precise_prefix")
    events = Events(["a:1", "b:1"])
    policy.use_events(events)
    text = " ".join(words[:100])
    store(events.subs["b:1"], tok.encode(text).ids)
    view = RequestView({"prompt": text + " w7 w9"})
    LocalTokenizer(str(path)).tokenize(view)  # as the router does before the policy chooses
    chosen, decision = policy.choose([Inst("a:1"), Inst("b:1")], view)
    assert chosen.address == "b:1" and decision.reason == "prefix_match" and decision.matched == 96
    assert chain_hashes(tok.encode(text).ids, 16)[:6] == chain_hashes(tok.encode(text + " w7").ids, 16)[:6]


def test_each_fallback_says_why_and_where_it_is_counted():
    a, b = Inst("a:1"), Inst("b:1")
    policy = policies.create("precise_prefix")
    prompt = list(range(1, 100))
    # no events at all, then one candidate without a stream: counted at the candidates concerned
    assert policy.choose([a, b], ids(prompt))[1].fallback_at == ["a:1", "b:1"]
    events = Events(["a:1"])
    policy.use_events(events)
    decision = policy.choose([a, b], ids(prompt))[1]
    assert (decision.fallback, decision.fallback_at) == ("events_off", ["b:1"])
    # both flowing, nothing stored yet: no block size to cut the prompt with
    events.subs["b:1"] = Sub()
    decision = policy.choose([a, b], ids(prompt))[1]
    assert (decision.fallback, decision.fallback_at) == ("no_block_stored", ["a:1", "b:1"])
    store(events.subs["a:1"], prompt[:32])
    events.subs["b:1"].index.apply(BlockStored([9], None, prompt[:32], 32))  # another engine block size
    assert policy.choose([a, b], ids(prompt))[1].fallback == "block_size_mismatch"
    # the request's own: its /tokenize failed; counted at the instance chosen
    events.subs["b:1"] = Sub()
    text = RequestView({"prompt": "some text"})
    text.no_ids = "tokenize_failed"
    chosen, decision = policy.choose([a, b], text)
    assert (decision.fallback, decision.fallback_at) == ("tokenize_failed", [chosen.address])
    assert policy.choose([a, b], ids(prompt))[1].fallback is None  # precise again
    expected = {"a:1": 3, "b:1": 4}  # a: no events, nothing stored, mismatch; b: also without a stream
    expected[chosen.address] += 1
    assert policy.fallbacks == expected
