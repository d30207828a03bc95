"""Prompt text of the benchmarks: random prompts of common English words.

Each word is one token (with its leading space) in the GPT-2 style BPE vocabularies of
Llama-family tokenizers, so a prompt of N words is about N tokens; the server's own count
(``usage.prompt_tokens``) is what the reports show.
"""

from __future__ import annotations

import math
import random

_WORD_TEXT = """
    the of and to in is was for on are with as his they be at one have this from or had by
    word but what some we can out other were all there when up use your how said an each she
    which do their time if will way about many then them write would like so these her long
    make thing see him two has look more day could go come did number sound no most people
    my over know water than call first who may down side been now find any new work part
    take get place made live where after back little only round man year came show every
    good me give our under name very through just form sentence great think say help low
    line differ turn cause much mean before move right boy old too same tell does set three
    want air well also play small end put home read hand port large spell add even land here
    must big high such follow act why ask men change went light kind off need house picture
    try us again animal point mother world near build self earth father head stand own page
    should country found answer school grow study still learn plant cover food sun four
    between state keep eye never last let thought city tree cross farm hard start might
    story saw far sea draw left late run while press close night real life few north open
    seem together next white children begin got walk example ease paper group always music
    those both mark often letter until mile river car feet care second book carry took
    science eat room friend began idea fish mountain stop once base hear horse cut sure
    watch color face wood main
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())  # 292 distinct words, in this order


def random_prompt(rng: random.Random, num_words: int) -> str:
    """A prompt of ``num_words`` common words drawn with ``rng`` (distinct across requests,
    so prefix caches do not flatter the figures)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """``n`` integers uniform in [mean·(1−r), mean·(1+r)], each at least 1 (vLLM's
    ``--random-range-ratio`` convention)."""
    lo = max(1, int(math.floor(mean * (1.0 - range_ratio))))
    hi = max(lo, int(math.ceil(mean * (1.0 + range_ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]
