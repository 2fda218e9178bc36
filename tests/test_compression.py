"""Gradient compression: codec kernels (single process) and compressed allreduce (MPI).

Kernels are checked through hpcdl._core's whole-array hooks against numpy;
the MPI tests check every rank's result against the documented error bound,
for bitwise equality across ranks, and the error-feedback identity.
"""

import hashlib
import math

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import hpcdl
from conftest import agree, outcome
from hpcdl import _core
from hpcdl.compression import BF16, FP16, Int8, NoCompression, TopK, from_config, from_text, from_text_list

WORLD = MPI.COMM_WORLD
ODD_COUNTS = [0, 1, 2, 3, 5, 7, 63, 64, 65, 255, 257, 4097, 100_003]


def roundtrip(codec, x, stream=0):
    enc = np.empty(codec.encoded_size(x.size), dtype=np.uint8)
    err = np.empty_like(x)
    _core.codec_encode_into(codec.canonical(), x, enc, err, stream)
    out = np.empty_like(x)
    _core.codec_decode_into(codec.canonical(), enc, out)
    return enc, out, err


def k_largest(x, k):
    """Indices of the k largest magnitudes of x, ascending; lower indices win ties."""
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


def topk_sum_in_rank_order(inputs, codec):
    """What every rank must compute: each input's k largest, summed in rank order in float32."""
    expected = np.zeros(inputs[0].size, np.float32)
    for x in inputs:
        keep = k_largest(x, codec.k(x.size))
        expected[keep] += x[keep]
    return expected


def block_absmax(x, block):
    """max |x| of each element's block, element-wise."""
    n = x.size
    pad = (-n) % block
    a = np.abs(np.concatenate([x, np.zeros(pad, x.dtype)])).reshape(-1, block).max(axis=1)
    return np.repeat(a, block)[:n]


# ---- single-process: codec kernels and settings ----

@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_int8_error_within_half_a_step_per_block(block):
    rng = np.random.default_rng(block)
    for n in ODD_COUNTS:
        x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3], n)).astype(np.float32)
        enc, out, err = roundtrip(Int8(block=block), x)
        assert enc.size == math.ceil(n / block) * 4 + n
        bound = block_absmax(x, block) / 254 * (1 + 1e-6)
        assert np.all(np.abs(out - x) <= bound), n
        np.testing.assert_array_equal(err, x - out)


def test_int8_zeros_constants_and_extremes():
    codec = Int8(block=16)
    _, out, _ = roundtrip(codec, np.zeros(100, np.float32))
    assert np.all(out == 0) and not np.signbit(out).any()
    c = np.full(33, -3.25, np.float32)
    _, out, _ = roundtrip(codec, c)
    assert np.all(np.abs(out - c) <= 3.25 / 254 * 1.000001)
    big = np.array([3e38, -3e38, 1e-38, 0], np.float32)
    _, out, _ = roundtrip(codec, big)
    assert np.all(np.isfinite(out)) and out[0] > 2.9e38 and out[1] < -2.9e38


def test_int8_nan_and_inf_poison_their_block_only():
    x = np.ones(64, np.float32)
    x[3], x[40] = np.nan, np.inf
    _, out, _ = roundtrip(Int8(block=16), x)
    assert np.all(np.isnan(out[0:16])) and np.all(np.isnan(out[32:48]))
    assert np.all(out[16:32] == 1) and np.all(out[48:] == 1)


def test_int8_stochastic_rounding_is_reproducible_and_unbiased():
    codec = Int8(block=32, rounding="stochastic", seed=11)
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    a, out_a, _ = roundtrip(codec, x, stream=5)
    b, _, _ = roundtrip(codec, x, stream=5)
    c, _, _ = roundtrip(codec, x, stream=6)
    other_seed, _, _ = roundtrip(Int8(block=32, rounding="stochastic", seed=12), x, stream=5)
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != c.tobytes() and a.tobytes() != other_seed.tobytes()
    step = block_absmax(x, 32) / 127
    assert np.all(np.abs(out_a - x) <= step * (1 + 1e-6))
    mean = np.mean([roundtrip(codec, x, stream=s)[1] for s in range(200)], axis=0)
    # nearest rounding is off by up to step/2; stochastic rounding averages out
    assert np.abs(mean - x).mean() < 0.05 * step.mean()


@pytest.mark.parametrize("codec", [Int8(block=16), Int8(block=16, rounding="stochastic", seed=3), FP16(), BF16()],
                         ids=str)
def test_non_finite_inputs_leave_a_finite_residual(codec):
    """NaN, Inf and values the codec cannot hold (fp16 1e5, bf16 3.4e38) decode as
    non-finite (per element; per block for int8), and their residual is 0, never
    Inf or NaN that error feedback would add back at every later step."""
    x = np.linspace(-2, 2, 64).astype(np.float32)
    x[3], x[21], x[40], x[50] = np.inf, np.nan, 1e5, 3.4e38
    _, out, err = roundtrip(codec, x)
    assert np.all(np.isfinite(err))
    bad = ~np.isfinite(out)
    if codec.name == "int8":
        expected_bad = np.repeat(~np.isfinite(block_absmax(x, 16)[::16]), 16)  # blocks 0 and 1; 2 and 3 hold big values
        np.testing.assert_array_equal(bad, expected_bad)
    else:
        assert bad[[3, 21]].all() and bad[50] and bad[40] == (codec.name == "fp16")
    np.testing.assert_array_equal(err[bad], 0)
    np.testing.assert_array_equal(err[~bad], x[~bad] - out[~bad])


def test_topk_unsent_non_finite_values_leave_the_residual():
    """More NaN/Inf than k: the k sent propagate, the rest are 0 in the residual
    (the engine's error-feedback path), never NaN or Inf carried to the next step."""
    codec = TopK(0.002)  # k = 2 of 1000
    x = np.linspace(-1, 1, 1000).astype(np.float32)
    specials = [7, 100, 400, 401, 999]
    x[specials] = [np.nan, np.inf, -np.inf, np.nan, np.inf]
    enc, out, err = roundtrip(codec, x)
    sent = enc[:8].view(np.uint32)
    np.testing.assert_array_equal(sent, [7, 401])  # NaN ranks above Inf
    assert np.isnan(out[7]) and np.isnan(out[401]) and np.count_nonzero(out) == 2
    assert np.all(np.isfinite(err))
    np.testing.assert_array_equal(err[specials], 0)
    rest = np.setdiff1d(np.arange(1000), specials)
    np.testing.assert_array_equal(err[rest], x[rest])


def test_int8_tiny_blocks_keep_zeros_and_stay_within_the_bound():
    """Blocks whose absmax is below 127/FLT_MAX (~3.7e-37, where 127/absmax
    overflows) down to subnormals: zeros decode to zero, the rest within half a
    step (plus the rounding of a subnormal scale: 128 half-ulps of 2^-149)."""
    codec = Int8(block=8)
    rng = np.random.default_rng(4)
    for amax in (3e-37, 1e-38, 1e-40, 1e-43, 1e-30):
        x = (rng.uniform(-1, 1, 64) * amax).astype(np.float32)
        x[::3] = 0
        x[5] = amax
        _, out, err = roundtrip(codec, x)
        assert np.all(out[x == 0] == 0), amax
        bound = block_absmax(x, 8) / 254 * (1 + 1e-6) + 2.0 ** -142
        assert np.all(np.abs(out - x) <= bound), (amax, np.abs(out - x).max())
        np.testing.assert_array_equal(err, x - out)


@pytest.mark.parametrize("codec,np_type", [(FP16(), np.float16), (BF16(), ml_dtypes.bfloat16)])
def test_casts_equal_numpy_casts_bitwise(codec, np_type):
    x = np.random.default_rng(1).standard_normal(1001).astype(np.float32) * 100
    x[:4] = [np.nan, np.inf, -np.inf, 1e6]
    x[4:10] = [1e-6, -3e-8, 6.1e-5, 65519, 65520, 2.0 ** -25]  # subnormals, overflow and rounding edges
    enc, out, _ = roundtrip(codec, x)
    with np.errstate(over="ignore"):
        expected = x.astype(np_type)
    assert enc.size == 2 * x.size
    assert enc.view(np.uint16)[1:].tobytes() == expected.view(np.uint16)[1:].tobytes()
    assert np.isnan(out[0])
    np.testing.assert_array_equal(out[1:], expected[1:].astype(np.float32))


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    rng = np.random.default_rng(2)
    for n, ratio in [(1, 0.5), (10, 0.3), (4097, 0.01), (100_000, 0.01), (100_000, 0.001), (50_000, 0.2)]:
        x = rng.permutation(np.arange(1, n + 1, dtype=np.float32)) * rng.choice([-1, 1], n).astype(np.float32)
        codec = TopK(ratio)
        k = codec.k(n)
        assert k == max(1, math.ceil(ratio * n))
        enc, out, err = roundtrip(codec, x)
        idx = enc[:4 * k].view(np.uint32)
        expected = k_largest(x, k)
        np.testing.assert_array_equal(idx, expected)
        np.testing.assert_array_equal(enc[4 * k:].view(np.float32), x[expected])
        np.testing.assert_array_equal(out + err, x)
        assert np.count_nonzero(out) == k


def test_topk_decode_refuses_a_corrupt_message():
    x = np.arange(1000, dtype=np.float32)
    codec = TopK(0.01)
    enc, _, _ = roundtrip(codec, x)
    out = np.full_like(x, 7.0)
    for j, value in ((3, 1000), (4, 0)):  # past the end; not ascending
        bad = enc.copy()
        bad[4 * j:4 * j + 4] = np.array([value], np.uint32).view(np.uint8)
        with pytest.raises(hpcdl.CorruptDataError, match=f"index {value} at pair {j}"):
            _core.codec_decode_into(codec.canonical(), bad, out)
        assert np.all(out == 7.0)  # refused before anything is written


def test_topk_tiny_ratio_keeps_one_ties_and_nan():
    assert TopK(1e-9).k(1000) == 1 and TopK(1.0).k(7) == 7 and TopK(0.5).k(0) == 0
    x = np.zeros(9000, np.float32)
    x[[10, 20, 30]] = 5.0  # ties: lower indices win
    enc, _, _ = roundtrip(TopK(2 / 9000), x)
    np.testing.assert_array_equal(enc[:8].view(np.uint32), [10, 20])
    x[4000] = np.nan
    enc, out, _ = roundtrip(TopK(1 / 9000), x)
    assert enc[:4].view(np.uint32)[0] == 4000 and np.isnan(out[4000])


def test_topk_exact_whatever_the_sampled_threshold_guesses():
    """Heavy ties at the cut, a sample that guesses too high (too few candidates)
    and one that guesses too low (too many): always exactly the k largest."""
    n, codec = 100_000, TopK(0.01)
    k = codec.k(n)
    ties = ((np.arange(n) * 7) % 13).astype(np.float32)
    sampled = np.zeros(n, bool)
    sampled[::n // 16384] = True  # where the selector samples
    too_high = np.where(sampled, 1000.0 + np.arange(n), np.arange(n) % 97).astype(np.float32)
    too_low = np.where(sampled, 0.0, 1.0 + np.arange(n) % 89).astype(np.float32)
    for x in (ties, too_high, too_low, -ties):
        enc, out, err = roundtrip(codec, x)
        np.testing.assert_array_equal(enc[:4 * k].view(np.uint32), k_largest(x, k))
        np.testing.assert_array_equal(out + err, x)


def test_codec_configs_round_trip_and_reject_bad_settings():
    for codec in (NoCompression(), FP16(), BF16(), Int8(), Int8(block=64, rounding="stochastic", seed=3),
                  TopK(0.01)):
        again = from_config(codec.get_config())
        assert again == codec and again.canonical() == codec.canonical()
    assert str(Int8()) == "int8(block=256)" and str(TopK(0.01)) == "topk(ratio=0.01)"
    assert str(NoCompression()) == "none" and NoCompression().canonical() == ""
    for bad in (lambda: Int8(block=0), lambda: Int8(rounding="up"), lambda: TopK(0), lambda: TopK(1.5),
                lambda: TopK(float("nan")), lambda: from_config({"name": "zip"}),
                lambda: Int8.from_config({"name": "topk", "ratio": 0.1})):
        with pytest.raises(ValueError):
            bad()


def test_the_core_checks_every_codec_setting():
    """hpcdl.compression spells settings as the core's text; the core's parser is the one check."""
    for bad in (lambda: Int8(block=2**24 + 1), lambda: Int8(block=True), lambda: Int8(block=2.0),
                lambda: Int8(seed=-1), lambda: Int8(seed=2**63), lambda: Int8(rounding="nearest,block=3"),
                lambda: TopK(True), lambda: TopK("0.5"), lambda: TopK(float("inf")),
                lambda: TopK(0.5, algorithm="dense")):
        with pytest.raises(ValueError, match="compression '"):
            bad()
    edge = Int8(block=2**24, rounding="stochastic", seed=2**63 - 1)
    assert edge.encoded_size(2**24) == 4 + 2**24 and TopK(1).ratio == 1.0


def test_from_text_reads_what_str_writes():
    codecs = [NoCompression(), FP16(), BF16(), Int8(), Int8(block=64), Int8(block=64, rounding="stochastic", seed=3),
              TopK(0.01), TopK(0.25, algorithm="split"), TopK(1e-05, algorithm="allgather")]
    for codec in codecs:
        again = from_text(str(codec))
        assert again == codec and type(again) is type(codec), (str(codec), again)
    assert from_text("int8") == Int8() and from_text("topk") == TopK()
    assert from_text_list("none, fp16,int8(block=64,rounding=stochastic,seed=3),topk(ratio=0.5)") == \
        [NoCompression(), FP16(), Int8(64, "stochastic", 3), TopK(0.5)]
    for bad in ("zip", "int8(block=0)", "topk(ratio=2)", "int8(block=64", "topk(ratio=0.1,algorithm=auto)"):
        with pytest.raises(ValueError):
            from_text(bad)


def test_encode_into_and_decode_into_run_the_core_kernels():
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    for codec, bound in ((FP16(), 2**-11), (Int8(block=64), 1 / 254), (TopK(0.1), None)):
        enc = np.empty(codec.encoded_size(x.size), np.uint8)
        out, err = np.empty_like(x), np.empty_like(x)
        codec.encode_into(x, enc, err)
        codec.decode_into(enc, out)
        np.testing.assert_allclose(out + err, x, rtol=0, atol=1e-6)  # err is what the encoding dropped
        if bound is None:  # top-k: the k largest magnitudes exactly, zero elsewhere
            np.testing.assert_array_equal(np.flatnonzero(out), k_largest(x, codec.k(x.size)))
        else:
            assert np.all(np.abs(out - x) <= bound * np.abs(x).max())
        with pytest.raises(ValueError, match="bytes"):
            codec.decode_into(enc[:-1], out)


def test_bad_compression_arguments_fail_before_communication():
    with pytest.raises(TypeError, match="compression"):
        hpcdl.allreduce(np.ones(4, np.float32), compression="int8")
    for dtype in ("int32", "float64", "float16"):
        with pytest.raises(ValueError, match="float32"):
            hpcdl.allreduce(np.ones(4, dtype), compression=Int8())
    with pytest.raises(ValueError, match="unknown compression"):
        _core.codec_encoded_size("zip(level=9)", 4)


# ---- MPI: compressed allreduce ----

def contribution(rank, count, scale=1.0):
    rng = np.random.default_rng(500 + rank)
    return (rng.standard_normal(count) * scale).astype(np.float32)


def digest(a):
    return hashlib.sha1(a.tobytes()).hexdigest()


def int8_ring_bound(inputs, block, size):
    """Documented bound: ((1 + 1/254)^p - 1) * sum over ranks of the absmax over
    each element's block (taken over a window of 2*block - 1, since chunk
    boundaries shift the blocks), plus float32 rounding of the sums."""
    n = inputs[0].size
    total = np.zeros(n)
    for x in inputs:
        padded = np.concatenate([np.zeros(block - 1), np.abs(x.astype(np.float64)), np.zeros(block - 1)])
        total += np.lib.stride_tricks.sliding_window_view(padded, 2 * block - 1).max(axis=1)
    return ((1 + 1 / 254) ** size - 1) * total + 4 * size * 2.0 ** -23 * total


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_int8_ring_within_bound_and_bitwise_identical(op):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    problems = []
    try:
        for chunk_bytes in (256, 1 << 20):
            hpcdl.configure(chunk_bytes=chunk_bytes)
            for count in ODD_COUNTS:
                inputs = [contribution(r, count) for r in range(size)]
                data = inputs[rank].copy()
                hpcdl.allreduce(data, op=op, compression=Int8(block=64))
                reference = np.sum([x.astype(np.float64) for x in inputs], axis=0)
                bound = int8_ring_bound(inputs, 64, size) if count else np.zeros(0)
                if op == "average":
                    reference, bound = reference / size, bound / size
                err = np.abs(data - reference)
                if not np.all(err <= bound):
                    problems.append(f"chunk {chunk_bytes} count {count}: err {err.max()} > {bound[err.argmax()]}")
                if len(set(WORLD.allgather(digest(data)))) != 1:
                    problems.append(f"chunk {chunk_bytes} count {count}: ranks differ")
    finally:
        hpcdl.configure(chunk_bytes=_core.DEFAULT_CHUNK_BYTES)
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [FP16(), BF16(), Int8(rounding="stochastic", seed=5), TopK(0.05),
                                   TopK(0.05, algorithm="split")], ids=str)
def test_other_codecs_bitwise_identical_and_close(codec):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rel = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}.get(codec.name, 2 / 127)
    problems = []
    for count in ODD_COUNTS:
        inputs = [contribution(r, count) for r in range(size)]
        data = inputs[rank].copy()
        hpcdl.allreduce(data, compression=codec)
        if len(set(WORLD.allgather(digest(data)))) != 1:
            problems.append(f"count {count}: ranks differ")
        if codec.name != "topk" and count:
            scale = np.sum([np.abs(x) for x in inputs], axis=0).max()
            err = np.abs(data - np.sum(inputs, axis=0, dtype=np.float64)).max()
            if err > size * rel * scale:
                problems.append(f"count {count}: err {err}")
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_topk_allreduce_sums_every_ranks_k_largest_in_rank_order():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    problems = []
    for count, ratio in [(1, 0.01), (5, 0.01), (1000, 0.01), (100_003, 0.01), (4097, 1.0), (2_000_003, 0.01)]:
        inputs = [contribution(r, count) for r in range(size)]
        codec = TopK(ratio, algorithm="allgather")
        expected = topk_sum_in_rank_order(inputs, codec)
        data = inputs[rank].copy()
        hpcdl.allreduce(data, compression=codec)
        if data.tobytes() != expected.tobytes():
            problems.append(f"count {count} ratio {ratio}: {np.count_nonzero(data != expected)} differ")
        if ratio == 1.0:
            dense = inputs[rank].copy()
            hpcdl.allreduce(dense)
            if not np.allclose(data, dense, rtol=1e-5, atol=1e-5):
                problems.append("ratio 1.0 differs from the dense result")
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [Int8(block=32), TopK(0.01), TopK(0.01, algorithm="split"), FP16()], ids=str)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_error_feedback_identity(codec, op):
    """After T steps: sum of applied results (in sum units) + sum over ranks of
    residuals == sum of the true gradients, up to float rounding."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    hpcdl.compression.reset_state()
    name = f"ef.{codec.name}.{op}"
    count, steps = 3001, 6
    applied = np.zeros(count, np.float64)
    true_total = np.zeros(count, np.float64)
    magnitude = 0.0
    for t in range(steps):
        grads = [contribution(r + 10 * t, count) for r in range(size)]
        true_total += np.sum(grads, axis=0, dtype=np.float64)
        magnitude += np.sum(np.abs(grads))
        g = grads[rank].copy()
        hpcdl.allreduce(g, op=op, name=name, compression=codec)
        applied += g.astype(np.float64) * (size if op == "average" else 1)
    residual = hpcdl.compression.residual(name)
    residual_sum = WORLD.allreduce(residual.astype(np.float64))
    gap = np.abs(applied + residual_sum - true_total).max()
    dropped = np.abs(true_total - applied).max()
    ok = gap <= 1e-5 * magnitude / count * size and dropped > 100 * gap
    hpcdl.compression.reset_state()
    gone = hpcdl.compression.residual(name) is None
    agree(WORLD, ok and gone, f"identity gap {gap}, dropped {dropped}, reset {gone}")


@pytest.mark.mpi(min_size=2)
def test_topk_large_tensor_identity_ties_and_misled_sample():
    """A tensor of 1 M values: averaged results plus residuals add up to the true
    gradients; heavy ties at the cut and a sample misled either way (its thresholds
    far too high, or far too low) still keep exactly the k largest, never more."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    codec, count = TopK(0.02, algorithm="allgather"), (1 << 20) + 77
    hpcdl.compression.reset_state()
    applied = np.zeros(count, np.float64)
    true_total = np.zeros(count, np.float64)
    for t in range(3):
        grads = [contribution(r + 10 * t, count) for r in range(size)]
        true_total += np.sum(grads, axis=0, dtype=np.float64)
        g = grads[rank].copy()
        hpcdl.allreduce(g, op="average", name="ef.large", compression=codec)
        applied += g.astype(np.float64) * size
    residual_sum = WORLD.allreduce(hpcdl.compression.residual("ef.large").astype(np.float64))
    gap = np.abs(applied + residual_sum - true_total).max()
    hpcdl.compression.reset_state()
    # Small integers: about 1/13 of all values tie at every magnitude, the cut
    # included; then large values exactly where the sample looks (every 64th
    # value is sampled here; these are every 16th of the first 65536 * 16), so
    # its threshold is far too high and the exact fallback has to find the rest.
    ties = [(((np.arange(count) * (7 + r)) % 13) - 6).astype(np.float32) for r in range(size)]
    misled = [contribution(r, count) for r in range(size)]
    for r, x in enumerate(misled):
        x[:65536 * 16:16] = 1000.0 + r + np.arange(65536, dtype=np.float32) / 65536
    differ = []
    for inputs in (ties, misled):
        data = inputs[rank].copy()
        hpcdl.allreduce(data, compression=codec)
        differ.append(int(np.count_nonzero(data != topk_sum_in_rank_order(inputs, codec))))
    # The sample misled the other way (tiny values where it looks): far more
    # than 4k + 64 above its threshold, yet no rank sends more than k pairs.
    low = contribution(rank, count)
    low[:65536 * 16:16] = 1e-6
    hpcdl.stats(reset=True)
    hpcdl.allreduce(low, compression=codec)
    sent = sum(row["bytes_sent"] for row in hpcdl.stats(reset=True)["allreduce"].values())
    same = len(set(WORLD.allgather(digest(low)))) == 1
    limit = (size - 1) * 8 * codec.k(count)
    agree(WORLD, gap <= 1e-4 and differ == [0, 0] and same and sent <= limit,
          f"identity gap {gap}, values differing from the k largest (ties, misled sample): {differ}, "
          f"ranks identical {same}, sent {sent} of at most {limit} bytes")


@pytest.mark.mpi(min_size=2)
def test_error_feedback_recovers_what_topk_dropped():
    """A constant gradient under top-k 10%: with error feedback every element is
    eventually sent; the running total tracks the truth far better than without."""
    size = WORLD.Get_size()
    hpcdl.compression.reset_state()
    count, steps = 1000, 100
    with_ef, without = np.zeros(count), np.zeros(count)
    grad = np.linspace(0.5, 1.5, count).astype(np.float32)
    for _ in range(steps):
        a, b = grad.copy(), grad.copy()
        hpcdl.allreduce(a, name="ef.constant", compression=TopK(0.1))
        hpcdl.allreduce(b, compression=TopK(0.1))
        with_ef += a
        without += b
    truth = steps * size * grad.astype(np.float64)
    err_ef, err_plain = np.abs(with_ef - truth).max(), np.abs(without - truth).max()
    hpcdl.compression.reset_state()
    agree(WORLD, err_ef < 0.2 * err_plain and hpcdl.compression.residual("ef.constant") is None,
          f"{err_ef} vs {err_plain}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [Int8(block=16), TopK(0.1), FP16()], ids=str)
def test_nan_and_inf_propagate_without_hanging(codec):
    rank = WORLD.Get_rank()
    data = np.ones(1000, np.float32)
    if rank == 0:
        data[5], data[700] = np.nan, np.inf
        data[100] = 50  # make topk pick more than the specials
    hpcdl.allreduce(data, compression=codec)
    same = len(set(WORLD.allgather(digest(data)))) == 1
    agree(WORLD, same and not np.isfinite(data[5]) and not np.isfinite(data[700]) and np.isfinite(data[300]),
          f"{data[[5, 700, 300]]}, same {same}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec,bad", [(FP16(), 1e5), (FP16(), np.inf), (BF16(), np.nan), (Int8(block=16), np.inf),
                                       (Int8(block=512), np.nan), (TopK(0.1), np.inf), (TopK(0.002), np.nan)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("op", ["sum", "average"])
def test_one_non_finite_step_does_not_poison_error_feedback(codec, bad, op):
    """One step where rank 0's g[3] and g[1500:1510] are non-finite (AMP's loss
    scaling makes such steps on purpose; top-k(0.002) keeps 4 of these 11): that
    step's result is non-finite at g[3], every later step with all-ones inputs
    is finite on every rank, and so is every residual."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    hpcdl.compression.reset_state()
    name = f"ef.poison.{codec}.{op}"
    count, problems = 2000, []
    for step in range(4):
        g = np.ones(count, np.float32)
        if step == 0 and rank == 0:
            g[3] = g[1500:1510] = bad
        hpcdl.allreduce(g, op=op, name=name, compression=codec)
        residual = hpcdl.compression.residual(name)
        if not np.all(np.isfinite(residual)):
            problems.append(f"step {step}: {np.count_nonzero(~np.isfinite(residual))} non-finite residuals")
        if step == 0 and np.isfinite(g[3]):
            problems.append(f"step 0: g[3] = {g[3]}, the non-finite input was hidden")
        if step > 0 and not np.all(np.isfinite(g)):
            problems.append(f"step {step}: {np.count_nonzero(~np.isfinite(g))} non-finite results, g[3] = {g[3]}")
        if step > 0 and codec.name != "topk" and not np.allclose(g, size if op == "sum" else 1, rtol=1e-2):
            problems.append(f"step {step}: results {g.min()}..{g.max()}")
    hpcdl.compression.reset_state()
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_codec_disagreement_is_a_mismatch_on_every_rank():
    rank = WORLD.Get_rank()
    data = np.ones(100, np.float32)
    before = data.copy()
    codec = Int8(block=128) if rank == 1 else Int8()
    _, err = outcome(hpcdl.allreduce, data, name="mismatched.codec", compression=codec)
    message = str(err)
    ok = (isinstance(err, hpcdl.MismatchError) and "compression differs" in message
          and "int8(block=128) on rank 1" in message and np.array_equal(data, before))
    _, err2 = outcome(hpcdl.allreduce, data.copy(), name="codec.vs.none",
                      compression=None if rank == 0 else FP16())
    ok2 = isinstance(err2, hpcdl.MismatchError) and "none on rank 0" in str(err2)
    agree(WORLD, ok and ok2, f"{err!r} / {err2!r}")


@pytest.mark.mpi(min_size=2)
def test_stats_measure_compressed_bytes_exactly():
    size = WORLD.Get_size()
    n, block = 100_003, 256
    hpcdl.stats(reset=True)
    hpcdl.allreduce(np.ones(n, np.float32), compression=Int8(block=block))
    hpcdl.allreduce(np.ones(n, np.float32), compression=TopK(0.01, algorithm="allgather"))
    hpcdl.allreduce(np.ones(n, np.float32))
    rows = hpcdl.stats()["allreduce"]
    int8, topk, dense = rows["int8(block=256)"], rows["topk(ratio=0.01,algorithm=allgather)"], rows["none"]
    seg_lens = [n // size + (1 if s < n % size else 0) for s in range(size)]  # one chunk per segment here
    expected_int8 = 2 * (size - 1) * sum(math.ceil(s / block) * 4 + s for s in seg_lens)
    expected_topk = size * (size - 1) * 8 * TopK(0.01).k(n)
    totals = {k: WORLD.allreduce(r["bytes_sent"]) for k, r in (("int8", int8), ("topk", topk))}
    ok = (totals["int8"] == expected_int8 and totals["topk"] == expected_topk
          and int8["dense_bytes"] == dense["bytes_sent"] == topk["dense_bytes"]
          and int8["dense_bytes"] / int8["bytes_sent"] > 3.9 and int8["ops"] == 1 and int8["seconds"] > 0)
    agree(WORLD, ok, f"{rows}, totals {totals} vs {expected_int8}, {expected_topk}")
