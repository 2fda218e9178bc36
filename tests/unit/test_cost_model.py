"""bench/cost_model.py's invariants, single process: the bytes and messages each
scheme is charged per rank (dense ring 2(P-1)/P of the payload, the split's flat
in P, the allgather's linear in P), the ring's pipeline bounds, that the fit
recovers the CPU terms, alpha and beta that made its points, that `codecs` +
`predict` write a full CSV and a PNG from this machine's kernels, and that
bench/netcluster.sh refuses bad --hosts/--rate/--cpus before touching the network.
No timings are asserted."""

import csv
import dataclasses
import math
import os
import subprocess

import pytest

import cost_model as cm  # bench/cost_model.py (tests/conftest.py puts bench/ on sys.path)
from conftest import ROOT

CODEC = {t: 1e-10 * (i + 1) for i, t in enumerate(cm.CODEC_TERMS)}  # made-up CPU terms, seconds per value
RANKS = [2, 3, 4, 8, 16, 100, 1024]


def machine(**kw):
    base = dict(alpha=20e-6, beta=1 / 1.2e9, codec=CODEC, kappa=2.0, net=0.5e-9)
    base.update(kw)
    return cm.Machine(**base)


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("n", [1, 1000, 4 << 20, 16 << 20])
def test_ring_bytes_are_2_p_minus_1_over_p_of_the_payload(p, n):
    for scheme, width in cm.RING_WIDTH.items():
        if scheme == "dense" and cm.dense_algorithm(p, n) != "ring":
            continue  # recursive doubling or halving-doubling (the next tests)
        messages, sent = cm.traffic(scheme, p, n)
        assert sent == pytest.approx(2 * (p - 1) / p * n * width, rel=1e-12)
        assert sent < 2 * n * width  # bounded in P: the ring's point
        chunks = max(1, math.ceil(4 * math.ceil(n / p) / cm.CHUNK_BYTES))
        assert messages == 2 * (p - 1) * chunks
    if 4 * n > cm.RECURSIVE_DOUBLING_MAX_BYTES:
        assert cm.traffic("mpi", p, n)[1] == cm.traffic("dense", p, n)[1]
        assert cm.traffic("fp16", p, n)[1] == pytest.approx(cm.traffic("dense", p, n)[1] / 2)


def test_small_dense_allreduce_rounds_grow_as_log_p_and_match_the_core():
    """Up to RECURSIVE_DOUBLING_MAX_BYTES the dense allreduce is recursive doubling: rounds
    log2 P (+2 off powers of two) against the ring's 2(P - 1), the whole buffer each round."""
    from hpcdl import _core

    assert cm.RECURSIVE_DOUBLING_MAX_BYTES == _core.RECURSIVE_DOUBLING_MAX_BYTES
    n = cm.RECURSIVE_DOUBLING_MAX_BYTES // 4
    rounds = {2: 1, 3: 3, 4: 2, 8: 3, 16: 4, 100: 8, 1024: 10}
    buffers = {2: 1, 3: 2, 4: 2, 8: 3, 16: 4, 100: 7, 1024: 10}
    for p in RANKS:
        assert cm.traffic("dense", p, n) == (rounds[p], buffers[p] * 4.0 * n)
        if p & (p - 1):  # one value more: the ring
            assert cm.traffic("dense", p, n + 1)[0] == 2 * (p - 1)
    assert cm.latency_rounds("dense", 1024, 1) == 10 < 2 * 1023


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("nbytes", [(64 << 10) + 4, 128 << 10, 4 << 20, 64 << 20, 256 << 20])
def test_mid_dense_allreduce_is_halving_doubling_over_powers_of_two_as_the_core_chooses(p, nbytes):
    """Over a power-of-two P of at least HALVING_DOUBLING_MIN_RANKS, a dense allreduce of at most
    HALVING_DOUBLING_MAX_SEGMENT_BYTES per rank takes 2 log2 P rounds with the ring's bytes; the
    model's choice is the core's."""
    from hpcdl import _core

    assert cm.HALVING_DOUBLING_MAX_SEGMENT_BYTES == _core.HALVING_DOUBLING_MAX_SEGMENT_BYTES
    assert cm.HALVING_DOUBLING_MIN_RANKS == _core.HALVING_DOUBLING_MIN_RANKS
    n = nbytes // 4
    assert cm.dense_algorithm(p, n) == _core.dense_allreduce_algorithm(p, nbytes)
    messages, sent = cm.traffic("dense", p, n)
    assert sent == pytest.approx(2 * (p - 1) / p * nbytes, rel=1e-12)
    if cm.dense_algorithm(p, n) == "halving-doubling":
        assert messages == 2 * (p.bit_length() - 1) == cm.latency_rounds("dense", p, n)
    else:
        assert messages >= 2 * (p - 1)


def test_topk_allgather_grows_with_p_and_split_stays_flat():
    n = 16 << 20
    k = cm.topk_k(n)
    gather = {p: cm.traffic("topk_allgather", p, n)[1] for p in RANKS}
    split = {p: cm.traffic("topk_split", p, n)[1] for p in RANKS}
    for p in RANKS:
        assert gather[p] == (p - 1) * 8 * k
        # The bound, "about 2x the P = 2 figure at any P": the pairs stay below 2 x 8k;
        # only the balance histogram (4 bins per rank at large P) and the 8-byte counts grow.
        assert split[p] <= 2.05 * split[2]
        assert split[p] - 2 * (p - 1) / p * 4 * max(4 * p, k // 64) - 8 * (p - 1) < 2 * (8 * k + 4096)
    assert gather[1024] / gather[2] == 1023
    assert all(split[a] <= split[b] for a, b in zip(RANKS, RANKS[1:]))  # grows, but toward a bound
    # The split's pairs go one peer per round, one message each (P - 1 rounds), then 7
    # collectives of log2 P rounds: rounds grow as P, and no message pays the per-message overhead.
    assert cm.traffic("topk_split", 1024, n)[0] == cm.latency_rounds("topk_split", 1024, n) == 1023 + 7 * 10
    assert cm.traffic("topk_split", 1024, n)[0] > 30 * cm.traffic("topk_split", 8, n)[0]
    m = machine(net=0.0, codec={t: 0.0 for t in cm.CODEC_TERMS}, beta=0.0)
    assert cm.predict_time("topk_split", 1024, n, dataclasses.replace(m, overhead=1e-6)) == pytest.approx(
        1093 * m.alpha
    )
    assert cm.traffic("topk_allgather", 1024, n)[0] == 1023


def test_one_rank_costs_nothing():
    for scheme in cm.SCHEMES:
        assert cm.traffic(scheme, 1, 1 << 20) == (0, 0.0)
        assert cm.predict_time(scheme, 1, 1 << 20, machine()) == 0.0
    with pytest.raises(ValueError, match="unknown scheme"):
        cm.traffic("gzip", 4, 100)


def test_ring_overlaps_transfer_and_kernels_only_across_chunks():
    m = machine(alpha=0.0)
    for p in (2, 8, 64):
        n = 64 << 20
        messages, sent = cm.traffic("int8", p, n)
        transfer = max(sent * m.beta, m.net * 2 * sent)
        compute = m.kappa * cm.kernel_seconds("int8", p, n, CODEC)
        t = cm.predict_time("int8", p, n, m)
        assert max(transfer, compute) <= t * (1 + 1e-12) <= (transfer + compute) * (1 + 1e-12)
        if messages == 2 * (p - 1):  # one chunk per step: nothing to overlap with
            assert t == pytest.approx(transfer + compute)
    # Top-k cannot overlap: selection, then the exchange, then the sum.
    t = cm.predict_time("topk_allgather", 8, 1 << 20, m)
    assert t == pytest.approx(
        cm.traffic("topk_allgather", 8, 1 << 20)[0] * m.alpha
        + max(
            cm.traffic("topk_allgather", 8, 1 << 20)[1] * m.beta,
            m.net * 2 * cm.traffic("topk_allgather", 8, 1 << 20)[1],
        )
        + m.kappa * cm.kernel_seconds("topk_allgather", 8, 1 << 20, CODEC)
    )


def test_a_smaller_share_of_a_core_slows_only_the_cpu_parts():
    n = 4 << 20
    free = machine(net=0.0, codec={t: 0.0 for t in cm.CODEC_TERMS})
    for scheme in cm.SCHEMES:  # nothing on the CPU: sharing cores changes nothing
        assert cm.predict_time(scheme, 8, n, free) == pytest.approx(
            cm.predict_time(scheme, 8, n, dataclasses.replace(free, cores=2))
        )
    m = machine()
    for scheme in cm.SCHEMES:
        own = cm.predict_time(scheme, 8, n, m)
        shared = cm.predict_time(scheme, 8, n, dataclasses.replace(m, cores=2))
        measured = cm.predict_time(scheme, 8, n, dataclasses.replace(m, cores=2, cpu_share=0.5))
        assert own < measured < shared  # 2 cores for 8 ranks: a quarter core each, unless measured


def test_burst_is_free_and_only_bytes_beyond_it_pay_the_rate():
    n = 1 << 20
    sent = cm.traffic("topk_allgather", 4, n)[1]
    m0, m1 = machine(net=0.0), machine(net=0.0, burst=sent / 2)
    assert cm.predict_time("topk_allgather", 4, n, m0) - cm.predict_time("topk_allgather", 4, n, m1) == pytest.approx(
        sent / 2 * m0.beta
    )


def test_fit_recovers_the_cpu_terms_and_alpha_that_made_the_points():
    truth = machine(alpha=300e-6, beta=1 / 2.4e6, kappa=2.1, net=0.0, burst=32 << 10)
    poll, points = 0.05, {}
    for scheme in cm.SCHEMES:
        for nbytes in (1 << 20, 4 << 20):
            n, share = nbytes // 4, 0.3
            t = cm.predict_time(scheme, 2, n, dataclasses.replace(truth, cpu_share=share))
            points[2, scheme, nbytes] = (t, cm.cpu_seconds(scheme, 2, n, truth) + poll * t, None, [], None, share)
    kappa, fitted_poll = cm.fit_cpu(points, CODEC)
    assert kappa == pytest.approx(truth.kappa) and fitted_poll == pytest.approx(poll)
    fitted = cm.fit(points, CODEC, truth.beta * 0.9, truth.burst, kappa)  # the stream 10 % faster than the ring
    assert fitted.alpha == pytest.approx(truth.alpha, rel=0.04)  # grid step 10^(1/60) ~ 3.9 %
    assert fitted.beta == pytest.approx(truth.beta, rel=0.012)  # grid step 1 % of the stream's rate
    # CPU that neither term explains never gives a negative one.
    flat = {key: (v[0], 1e-3, None, [], None, v[-1]) for key, v in points.items()}
    assert min(cm.fit_cpu(flat, CODEC)) >= 0


def test_codecs_then_predict_write_every_cell_and_a_figure(tmp_path):
    assert cm.main(["codecs", "--size", "1MiB", "--repeats", "1", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "cost-model-codecs.csv", newline="") as f:
        terms = {r["term"]: r for r in csv.DictReader(f)}
    assert set(terms) == set(cm.CODEC_TERMS)
    assert all(r["seconds_per_value"] == "" or float(r["seconds_per_value"]) > 0 for r in terms.values())
    measured = [t for t in terms if terms[t]["seconds_per_value"]]
    if len(measured) < len(terms):  # a thread clock too coarse for a 1 MiB kernel: predict must refuse
        with pytest.raises(SystemExit, match="lacks"):
            cm.main(["predict", "--out", str(tmp_path)])
        return
    assert cm.main(["predict", "--size", "64MiB", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "cost-model-predict.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 10 * len(cm.SCHEMES)  # 2 links x P = 2 .. 1024 x schemes
    assert all(float(r["predicted_s"]) > 0 for r in rows)
    by = {(float(r["link_Gbit"]), int(r["ranks"]), r["scheme"]): float(r["predicted_s"]) for r in rows}
    for p in (2, 64, 1024):  # a faster link never predicts a slower call
        for scheme in cm.SCHEMES:
            assert by[100.0, p, scheme] <= by[10.0, p, scheme]
    assert os.path.getsize(tmp_path / "cost-model-predict.png") > 10000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hosts", "1", "up"], "--hosts must be an integer in 2..254, got '1'"),
        (["--hosts", "eight", "stream"], "--hosts must be an integer in 2..254, got 'eight'"),
        (["--rate", "100", "streams"], "--rate must be a tc rate such as 100mbit or 1gbit, got '100'"),
        (["--rate", "fast", "up"], "--rate must be a tc rate such as 100mbit or 1gbit, got 'fast'"),
        (["--cpus", "half", "up"], "--cpus must be a positive number of cores such as 0.5, got 'half'"),
        (["--cpus", "0", "up"], "--cpus must be a positive number of cores such as 0.5, got '0'"),
        (["--cpus", "-1", "up"], "--cpus must be a positive number of cores such as 0.5, got '-1'"),
        (["cgroup", "first"], "usage:"),
        (["--hosts"], "usage:"),
        (["--hosts", "4", "sideways"], "usage:"),
    ],
)
def test_netcluster_refuses_bad_options_before_touching_the_network(argv, message):
    """Options are checked before any namespace is made (so this runs without root)."""
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "netcluster.sh"), *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and message in done.stderr, (done.returncode, done.stderr)


@pytest.mark.parametrize("seconds", ["2.5", "0", "ten"])
def test_netcluster_refuses_a_bad_stream_length_before_touching_the_network(seconds):
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "netcluster.sh"), "streams"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, HPCDL_STREAM_SECONDS=seconds),
    )
    expected = f"HPCDL_STREAM_SECONDS must be a whole number of seconds >= 1, got '{seconds}'"
    assert done.returncode == 2 and expected in done.stderr, (done.returncode, done.stderr)
