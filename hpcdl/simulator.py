"""A performance model of data loading in the spirit of NoPFS's: predicts
epoch times for (1) naive loading (each step reads its batch from the backing
store, then computes), (2) a staging buffer only (reads from the store overlap
compute, as a DataLoader with workers does), and (3) the clairvoyant
prefetcher (RAM, node-local disk, peers' RAM, store), for clusters we cannot
run. Pure Python, closed form: the frequency of a sample on one rank over E
epochs is Binomial(E, c/P) (each epoch a rank reads a random c*N/P of the
data; c < 1 by the dropped last batch), placement pours the most frequent
samples into RAM then disk, and each tier
is a resource with its own bandwidth; sources work in parallel with compute.
Peers: a rank's first use of a sample it caches comes from the store only if
no other rank cached it in an earlier epoch (else from that source peer), and
an uncached sample comes from a peer's RAM when some peer caches it.
Coalesced fills (read_bytes > 0): a rank's store fills are read in spans; the
spans, the gap bytes read through and the bytes the node's page cache shares
follow from the density of a look-ahead window's samples in the file
(_coalesced_store_time).

    python -m hpcdl.simulator --samples 1281167 --sample-bytes 110000 --ranks 1024 \
        --epochs 90 --batch 32768 --compute 0.25 --ram 25G --disk 300G \
        --store-bw 100G --store-iops 1e6 --disk-bw 2G --net-bw 12G
"""

import argparse
import math
from dataclasses import dataclass

from hpcdl.store.probe import read_settings
from hpcdl.units import size_or_auto, size_type

__all__ = ["System", "predict", "coalesced_reads", "main"]


@dataclass
class System:
    """One run and one machine. Bandwidths in bytes/s; the store's are for the
    whole cluster (a shared file system), the others per rank."""

    samples: int
    sample_bytes: float
    ranks: int
    epochs: int
    batch: int  # global batch
    compute: float  # seconds per step (forward + backward)
    ram_bytes: float = 0.0  # per rank
    disk_bytes: float = 0.0  # per rank
    store_bw: float = 1e9  # aggregate
    store_iops: float = 1e5  # aggregate reads per second
    disk_bw: float = 2e9  # per rank (read; writes assumed as fast)
    net_bw: float = 10e9  # per rank, peer transfers
    ram_bw: float = 10e9  # per rank memcpy into the staging buffer
    peers: bool = True
    read_bytes: float = 0.0  # coalesced fills: the largest span (0: one read per sample)
    read_gap: float = 0.0  # the largest gap read through
    lookahead_bytes: float = 0.0  # store fills sorted together
    node_ranks: int = 1  # ranks sharing one page cache (a node)


def _binomial_pmf(n, p):
    """P(X = f) for f = 0..n, computed in logs (n up to thousands of epochs)."""
    if p >= 1.0:
        return [0.0] * n + [1.0]
    logs = [
        math.lgamma(n + 1) - math.lgamma(f + 1) - math.lgamma(n - f + 1) + f * math.log(p) + (n - f) * math.log1p(-p)
        for f in range(n + 1)
    ]
    return [math.exp(x) for x in logs]


def _first_use_in_epoch(epochs, f, e):
    """P(a sample read in f of E epochs is first read in epoch e (1-based))."""
    if f == 0 or e > epochs - f + 1:
        return 0.0
    return math.comb(epochs - e, f - 1) / math.comb(epochs, f)


def _store_time(reads_all_ranks, sys):
    """Seconds the shared store needs for this many sample reads (bandwidth or IOPS bound)."""
    return max(reads_all_ranks * sys.sample_bytes / sys.store_bw, reads_all_ranks / sys.store_iops)


def coalesced_reads(fills, sys):
    """(reads, bytes) of one rank that fills `fills` samples from the store in
    spans. A look-ahead window's samples are a random d of the file's, so the
    gap before a sample (in samples) is geometric: a sample starts a new span
    when its gap exceeds read_gap (probability (1-d)^(m+1), m = read_gap /
    sample), else the gap is read through."""
    N, s = sys.samples, sys.sample_bytes
    if fills <= 0:
        return 0.0, 0.0
    d = min(min(sys.lookahead_bytes / s, fills) / N, 1.0) if sys.lookahead_bytes else min(1.0 / N, 1.0)
    m = int(sys.read_gap // s)
    gap = sum(k * s * d * (1.0 - d) ** k for k in range(1, m + 1))
    rank_bytes = fills * (s + gap)
    return max(fills * (1.0 - d) ** (m + 1) + rank_bytes / sys.read_bytes, 1.0), rank_bytes


def _coalesced_store_time(fills, sys):
    """Seconds the store needs when each rank fills `fills` samples in spans
    (coalesced_reads). Ranks of one node share the page cache: the node reads
    the union of their spans once. The samples the ranks fill are disjoint
    with peers (each sample's first cacher fills it), else random; the gap
    bytes read through fall anywhere."""
    N, s, P = sys.samples, sys.sample_bytes, sys.ranks
    if fills <= 0:
        return 0.0
    rank_spans, rank_bytes = coalesced_reads(fills, sys)
    n = max(min(sys.node_ranks, P), 1)
    fill_share, gap_share = min(fills / N, 1.0), min((rank_bytes - fills * s) / (N * s), 1.0)
    own = min(n * fill_share, 1.0) if sys.peers else 1.0 - (1.0 - fill_share) ** n
    node_bytes = min(n * rank_bytes, N * s * (own + (1.0 - own) * (1.0 - (1.0 - gap_share) ** n)))
    device = node_bytes / (n * rank_bytes)  # the share of the ranks' bytes (and spans) that reaches the store
    return max(P * rank_bytes * device / sys.store_bw, P * rank_spans * device / sys.store_iops)


def predict(sys):
    """Predicted seconds per epoch for each strategy: dict of lists (epoch 1..E)
    under 'naive', 'staging', 'prefetch', 'compute', plus the per-epoch share
    of each source in the prefetcher's reads ('sources': list of dicts)."""
    P, E, N = sys.ranks, sys.epochs, sys.samples
    steps = N // sys.batch
    reads = steps * sys.batch / P  # per rank per epoch
    compute = steps * sys.compute
    store_all = _store_time(reads * P, sys)
    naive = compute + store_all
    staging = max(compute, store_all)

    # Per rank: how many samples are read f times, most frequent first into RAM, then disk.
    cover = steps * sys.batch / N  # an epoch reads this fraction of the data, each sample by one rank
    pmf = _binomial_pmf(E, cover / P)
    ram_slots = sys.ram_bytes / sys.sample_bytes
    disk_slots = sys.disk_bytes / sys.sample_bytes
    tier_of = {}  # f -> (samples in ram, on disk, uncached)
    left_ram, left_disk = ram_slots, disk_slots
    for f in range(E, 0, -1):
        count = N * pmf[f]
        in_ram = min(count, left_ram)
        left_ram -= in_ram
        in_disk = min(count - in_ram, left_disk)
        left_disk -= in_disk
        tier_of[f] = (in_ram, in_disk, count - in_ram - in_disk)
    cached_ram = sum(v[0] for v in tier_of.values())
    cached = sum(v[0] + v[1] for v in tier_of.values())
    distinct = N * (1.0 - pmf[0])  # samples a rank reads at least once
    cached_share = min(cached / distinct, 1.0) if distinct else 0.0
    # Per earlier epoch: P(another rank read and cached the sample | this rank did not read it).
    other = cover * (P - 1) / P / max(1.0 - cover / P, 1e-12) * cached_share if sys.peers and P > 1 else 0.0
    # A sample a rank does not cache is in some peer's RAM with this probability
    # (each rank caches a random-looking cached_ram of the N samples).
    coverage = 1.0 - (1.0 - min(cached_ram / N, 1.0)) ** (P - 1) if sys.peers and P > 1 else 0.0

    prefetch, sources = [], []
    for e in range(1, E + 1):
        # Reads this epoch per tier (each sample read f times has f/E of its reads in epoch e),
        # and the cold first reads of cached samples, which come from the store (or a peer).
        hits = [0.0, 0.0, 0.0]
        first_uses = 0.0
        for f, (r, d, u) in tier_of.items():
            share = f / E
            first = _first_use_in_epoch(E, f, e)
            hits[0] += r * (share - first)
            hits[1] += d * (share - first)
            hits[2] += u * share
            first_uses += (r + d) * first
        # First uses: from the store when no other rank cached the sample in an earlier epoch.
        cold = first_uses * (1.0 - other) ** (e - 1)
        peer = (hits[2] * coverage) if e > 1 else 0.0
        peer += first_uses - cold
        store = hits[2] * (1.0 - coverage if e > 1 else 1.0) + cold
        if sys.read_bytes > 0:  # the first uses are tier fills, read in spans
            t_store = _coalesced_store_time(cold, sys) + _store_time((store - cold) * P, sys)
        else:
            t_store = _store_time(store * P, sys)
        disk_fills = sum(d * _first_use_in_epoch(E, f, e) for f, (_, d, _) in tier_of.items())
        t_disk = (hits[1] + disk_fills) * sys.sample_bytes / sys.disk_bw  # reads, plus writes of first uses
        t_peer = peer * sys.sample_bytes / sys.net_bw
        t_ram = reads * sys.sample_bytes / sys.ram_bw
        prefetch.append(max(compute, t_store, t_disk, t_peer, t_ram))
        total = max(sum(hits[:2]) + peer + store, 1e-12)
        sources.append({"ram": hits[0] / total, "disk": hits[1] / total, "peer": peer / total, "store": store / total})
    return {
        "naive": [naive] * E,
        "staging": [staging] * E,
        "prefetch": prefetch,
        "compute": [compute] * E,
        "sources": sources,
    }


_size = size_type(allow_zero=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m hpcdl.simulator")
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--sample-bytes", type=_size, required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True, help="global batch")
    ap.add_argument("--compute", type=float, required=True, help="seconds per step")
    ap.add_argument("--ram", type=_size, default=0)
    ap.add_argument("--disk", type=_size, default=0)
    ap.add_argument("--store-bw", type=_size, default=1e9)
    ap.add_argument("--store-iops", type=float, default=1e5)
    ap.add_argument("--disk-bw", type=_size, default=2e9)
    ap.add_argument("--net-bw", type=_size, default=10e9)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument(
        "--read-bytes",
        default="0",
        help="coalesced fills: largest span (0: per sample; auto: the "
        "prefetcher's rule for --store-iops and --store-bw)",
    )
    ap.add_argument("--read-gap", default="0", help="a size or auto")
    ap.add_argument("--lookahead", default="0", help="a size or auto")
    ap.add_argument("--node-ranks", type=int, default=1, help="ranks sharing a page cache")
    a = ap.parse_args(argv)
    try:
        reads = {
            "read_bytes": size_or_auto(a.read_bytes, "--read-bytes"),
            "read_gap": size_or_auto(a.read_gap, "--read-gap"),
            "lookahead_bytes": size_or_auto(a.lookahead, "--lookahead"),
        }
    except ValueError as exc:
        ap.error(str(exc))
    derived = read_settings(a.store_iops, a.store_bw, tier_bytes=a.ram + a.disk)
    reads = {k: derived[k] if v is None else v for k, v in reads.items()}
    system = System(
        samples=a.samples,
        sample_bytes=a.sample_bytes,
        ranks=a.ranks,
        epochs=a.epochs,
        batch=a.batch,
        compute=a.compute,
        ram_bytes=a.ram,
        disk_bytes=a.disk,
        store_bw=a.store_bw,
        store_iops=a.store_iops,
        disk_bw=a.disk_bw,
        net_bw=a.net_bw,
        peers=not a.no_peers,
        node_ranks=a.node_ranks,
        **reads,
    )
    out = predict(system)
    print(f"{'epoch':>5} {'naive s':>10} {'staging s':>10} {'prefetch s':>11} {'compute s':>10}  sources")
    for e in range(system.epochs):
        src = " ".join(f"{k} {v:.0%}" for k, v in out["sources"][e].items())
        print(
            f"{e + 1:>5} {out['naive'][e]:>10.2f} {out['staging'][e]:>10.2f} {out['prefetch'][e]:>11.2f} "
            f"{out['compute'][e]:>10.2f}  {src}"
        )


if __name__ == "__main__":
    main()
