"""The prefix cache's index matches the longest common token prefix with any entry: an
agent's next turn re-renders the last answer differently from the tokens generated, so the
entry it continues is not a prefix of it, and where several entries hold the deepest
common block the one agreeing longest past it is taken, not merely the most recent."""

from __future__ import annotations

from coordinator.engine.prefix_cache import BLOCK, PrefixCache


def test_a_re_rendered_turn_reuses_every_row_before_the_change():
    cache = PrefixCache(capacity_tokens=10_000)
    prompt = list(range(100, 170))  # 70 tokens: turn k's prompt
    generated = [900, 901, 902, 903]  # what the model wrote
    cache.insert(1, prompt + generated, None)
    rendered = [800, 801, 802]  # the template's rendering of that answer differs at once
    hit = cache.find(prompt + rendered + list(range(300, 330)))
    assert (hit.source, hit.length) == (1, len(prompt))  # not a whole entry, and no miss


def test_the_longest_agreement_wins_over_the_most_recent():
    cache = PrefixCache(capacity_tokens=10_000)
    shared = list(range(100, 100 + 3 * BLOCK))  # three full blocks both entries hold
    longer = shared + list(range(500, 500 + BLOCK - 2)) + [1, 1]  # agrees 14 more
    shorter = shared + list(range(500, 503)) + list(range(700, 700 + BLOCK))  # 3 more
    cache.insert(1, longer, None)
    cache.insert(2, shorter, None)  # the most recent
    prompt = shared + list(range(500, 500 + BLOCK - 2)) + [7, 7, 7]
    hit = cache.find(prompt)
    assert (hit.source, hit.length) == (1, 3 * BLOCK + BLOCK - 2)
    equal = shared + [42] * 5  # both agree for exactly the shared blocks: the most recent
    assert cache.find(equal).source == 2
