"""The agreement's report tree as documented (docs/architecture.md, "Report
tree"), derived here from its parent rule alone, for tests that check the
engine's counts against it."""

import os

from hpcdl import _env


def radix_in_effect(size):
    """The tree's radix in this process's environment: HPCDL_AGREEMENT_FLAT=1 is
    radix P (every rank a child of rank 0); unset, the documented default."""
    if os.environ.get("HPCDL_AGREEMENT_FLAT", "0") != "0":
        return max(2, size)
    return int(os.environ.get("HPCDL_AGREEMENT_RADIX", _env.ENGINE_DOCS["HPCDL_AGREEMENT_RADIX"][0]))


def parent(rank, radix):
    """Rank's parent: rank with its lowest nonzero base-radix digit cleared."""
    place = 1
    while rank // place % radix == 0:
        place *= radix
    return rank - rank // place % radix * place


def children_counts(size, radix):
    """{rank: how many ranks have it as their parent} for ranks 0 .. size - 1."""
    counts = dict.fromkeys(range(size), 0)
    for rank in range(1, size):
        counts[parent(rank, radix)] += 1
    return counts


def one_hop_in_effect(size):
    """Whether operations on a communicator of `size` ranks may run one-hop
    (docs/architecture.md, "One-hop agreement"): at most
    HPCDL_AGREEMENT_ONE_HOP_RANKS ranks, more than one, and a flat report tree."""
    limit = int(os.environ.get("HPCDL_AGREEMENT_ONE_HOP_RANKS", _env.ENGINE_DOCS["HPCDL_AGREEMENT_ONE_HOP_RANKS"][0]))
    return 1 < size <= limit and radix_in_effect(size) >= size
