"""Gradient compression, single process: codec kernels and settings.

Kernels are checked through hpcdl._core's whole-array hooks against numpy;
tests/mpi/test_compression_mpi.py checks every rank's compressed allreduce
against the documented error bound, for bitwise equality across ranks, and
the error-feedback identity.
"""

import json
import math
import os
import sys

import ml_dtypes
import numpy as np
import pytest

import hpcdl
from hpcdl import _core
from hpcdl.compression import BF16, FP16, Int8, NoCompression, TopK, from_config, from_text, from_text_list

from conftest import MPIEXEC, finish_job, start_job
from helpers.compression import ODD_COUNTS, k_largest, topk_reuse_select


def roundtrip(codec, x, stream=0):
    enc = np.empty(codec.encoded_size(x.size), dtype=np.uint8)
    err = np.empty_like(x)
    _core.codec_encode_into(codec.canonical(), x, enc, err, stream)
    out = np.empty_like(x)
    _core.codec_decode_into(codec.canonical(), enc, out)
    return enc, out, err


def block_absmax(x, block):
    """max |x| of each element's block, element-wise."""
    n = x.size
    pad = (-n) % block
    a = np.abs(np.concatenate([x, np.zeros(pad, x.dtype)])).reshape(-1, block).max(axis=1)
    return np.repeat(a, block)[:n]


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


@pytest.mark.parametrize(
    "codec", [Int8(block=16), Int8(block=16, rounding="stochastic", seed=3), FP16(), BF16()], ids=str
)
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
        bound = block_absmax(x, 8) / 254 * (1 + 1e-6) + 2.0**-142
        assert np.all(np.abs(out - x) <= bound), (amax, np.abs(out - x).max())
        np.testing.assert_array_equal(err, x - out)


@pytest.mark.parametrize("codec,np_type", [(FP16(), np.float16), (BF16(), ml_dtypes.bfloat16)])
def test_casts_equal_numpy_casts_bitwise(codec, np_type):
    x = np.random.default_rng(1).standard_normal(1001).astype(np.float32) * 100
    x[:4] = [np.nan, np.inf, -np.inf, 1e6]
    x[4:10] = [1e-6, -3e-8, 6.1e-5, 65519, 65520, 2.0**-25]  # subnormals, overflow and rounding edges
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
        idx = enc[: 4 * k].view(np.uint32)
        expected = k_largest(x, k)
        np.testing.assert_array_equal(idx, expected)
        np.testing.assert_array_equal(enc[4 * k :].view(np.float32), x[expected])
        np.testing.assert_array_equal(out + err, x)
        assert np.count_nonzero(out) == k


def test_topk_decode_refuses_a_corrupt_message():
    x = np.arange(1000, dtype=np.float32)
    codec = TopK(0.01)
    enc, _, _ = roundtrip(codec, x)
    out = np.full_like(x, 7.0)
    for j, value in ((3, 1000), (4, 0)):  # past the end; not ascending
        bad = enc.copy()
        bad[4 * j : 4 * j + 4] = np.array([value], np.uint32).view(np.uint8)
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
    sampled[:: n // 16384] = True  # where the selector samples
    too_high = np.where(sampled, 1000.0 + np.arange(n), np.arange(n) % 97).astype(np.float32)
    too_low = np.where(sampled, 0.0, 1.0 + np.arange(n) % 89).astype(np.float32)
    for x in (ties, too_high, too_low, -ties):
        enc, out, err = roundtrip(codec, x)
        np.testing.assert_array_equal(enc[: 4 * k].view(np.uint32), k_largest(x, k))
        np.testing.assert_array_equal(out + err, x)


def test_codec_configs_round_trip_and_reject_bad_settings():
    for codec in (NoCompression(), FP16(), BF16(), Int8(), Int8(block=64, rounding="stochastic", seed=3), TopK(0.01)):
        again = from_config(codec.get_config())
        assert again == codec and again.canonical() == codec.canonical()
    assert str(Int8()) == "int8(block=256)" and str(TopK(0.01)) == "topk(ratio=0.01)"
    assert str(NoCompression()) == "none" and NoCompression().canonical() == ""
    for bad in (
        lambda: Int8(block=0),
        lambda: Int8(rounding="up"),
        lambda: TopK(0),
        lambda: TopK(1.5),
        lambda: TopK(float("nan")),
        lambda: from_config({"name": "zip"}),
        lambda: Int8.from_config({"name": "topk", "ratio": 0.1}),
    ):
        with pytest.raises(ValueError):
            bad()


def test_the_core_checks_every_codec_setting():
    """hpcdl.compression spells settings as the core's text; the core's parser is the one check."""
    for bad in (
        lambda: Int8(block=2**24 + 1),
        lambda: Int8(block=True),
        lambda: Int8(block=2.0),
        lambda: Int8(seed=-1),
        lambda: Int8(seed=2**63),
        lambda: Int8(rounding="nearest,block=3"),
        lambda: TopK(True),
        lambda: TopK("0.5"),
        lambda: TopK(float("inf")),
        lambda: TopK(0.5, algorithm="dense"),
    ):
        with pytest.raises(ValueError, match="compression '"):
            bad()
    edge = Int8(block=2**24, rounding="stochastic", seed=2**63 - 1)
    assert edge.encoded_size(2**24) == 4 + 2**24 and TopK(1).ratio == 1.0


def test_from_text_reads_what_str_writes():
    codecs = [
        NoCompression(),
        FP16(),
        BF16(),
        Int8(),
        Int8(block=64),
        Int8(block=64, rounding="stochastic", seed=3),
        TopK(0.01),
        TopK(0.25, algorithm="split"),
        TopK(1e-05, algorithm="allgather"),
    ]
    for codec in codecs:
        again = from_text(str(codec))
        assert again == codec and type(again) is type(codec), (str(codec), again)
    assert from_text("int8") == Int8() and from_text("topk") == TopK()
    assert from_text_list("none, fp16,int8(block=64,rounding=stochastic,seed=3),topk(ratio=0.5)") == [
        NoCompression(),
        FP16(),
        Int8(64, "stochastic", 3),
        TopK(0.5),
    ]
    for bad in (
        "zip",
        "int8(block=0)",
        "topk(ratio=2)",
        "int8(block=64",
        "topk(ratio=0.1,algorithm=auto)",
        "int8(block=64,blok=32)",
        "int8(block=64,block=32)",
        "topk(ratio=0.1,)",
        "int8()",
    ):
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


def test_topk_algorithm_setting_round_trips_and_is_checked():
    split = TopK(0.01, algorithm="split")
    assert str(split) == "topk(ratio=0.01,algorithm=split)" and str(TopK(0.01)) == "topk(ratio=0.01)"
    assert from_config(split.get_config()) == split and TopK(0.01) != split
    with pytest.raises(ValueError, match="algorithm"):
        TopK(0.01, algorithm="ring")
    with pytest.raises(ValueError, match="algorithm"):
        _core.codec_encoded_size("topk(ratio=0.01,algorithm=ring)", 10)
    assert split.encoded_size(1000) == TopK(0.01).encoded_size(1000) == 80


def test_auto_counts_the_splits_rounds_and_changes_its_mind_once_as_p_grows():
    """auto weighs bytes received plus a price per dependent round (the split has p + 6, the
    allgather one): the allgather at p = 2; for a tensor whose 8k is small against a round's
    price, the allgather at every p (the split's rounds grow with p as fast as the allgather's
    bytes); for a large one the split from small p on; never back once it took the split."""
    auto, ranks = TopK(0.01), [2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 128, 256, 512, 1024, 4096]
    for count in (1000, 100_000, 1_000_003, 16_000_000):  # p k within MPI's int counts
        chosen = [auto.algorithm_for(p, count) for p in ranks]
        assert chosen[0] == "allgather", (count, chosen)
        first_split = chosen.index("split") if "split" in chosen else len(chosen)
        assert set(chosen[first_split:]) <= {"split"}, (count, chosen)
    assert {auto.algorithm_for(p, 100_000) for p in ranks} == {"allgather"}
    assert auto.algorithm_for(3, 16_000_000) == auto.algorithm_for(1024, 1_000_003) == "split"
    for named in ("allgather", "split"):
        assert {TopK(0.01, algorithm=named).algorithm_for(p, 16_000_000) for p in ranks} == {named}
    with pytest.raises(ValueError, match="ranks"):
        auto.algorithm_for(0, 1000)


RESIDUAL_LIFETIME_JOB = """
import json, sys
import numpy as np
from mpi4py import MPI
import hpcdl
from hpcdl.compression import Int8, residual, residual_memory

seen = []
def step(name):
    hpcdl.allreduce(np.ones(1000, np.float32) / 3, name=name, compression=Int8())
    seen.append([residual("a") is not None, residual_memory()])

step("a")
for k in range(4):
    step(f"b{k}")  # "a" unused for 1, 2, 3, then 4 named compressed allreduces
if MPI.COMM_WORLD.Get_rank() == 0:
    json.dump(seen, open(sys.argv[1], "w"))
"""


def test_residuals_of_names_no_longer_used_are_freed(tmp_path):
    """With HPCDL_RESIDUAL_TTL_OPS=3 a name's residual lives while at most 3 other
    named compressed allreduces ran on its communicator since its last use, and is
    freed at the 4th; what the others take stays bounded by the lifetime too."""
    script = tmp_path / "job.py"
    script.write_text(RESIDUAL_LIFETIME_JOB)
    env = dict(os.environ, HPCDL_RESIDUAL_TTL_OPS="3")
    rc, out, _ = finish_job(
        start_job([MPIEXEC, "-n", "2", sys.executable, str(script), str(tmp_path / "seen")], env=env), 90
    )
    assert rc == 0, out
    seen = json.loads((tmp_path / "seen").read_text())
    one = 4 * 1000
    assert seen == [[True, one], [True, 2 * one], [True, 3 * one], [True, 4 * one], [False, 4 * one]], seen


@pytest.mark.parametrize("value", ["-1", "ten", "1e3", " 5"])
def test_residual_lifetime_setting_is_checked_at_import(value):
    """A value the core could not read fails at import, naming the variable."""
    proc = start_job([sys.executable, "-c", "import hpcdl"], env=dict(os.environ, HPCDL_RESIDUAL_TTL_OPS=value))
    rc, out, _ = finish_job(proc, 60)
    assert rc != 0 and "HPCDL_RESIDUAL_TTL_OPS" in out, out


def reuse_step(codec, data, residual, state):
    """One call of the core's selection (hook) and of the float64 reference;
    returns (sent indices, the core's state, problems)."""
    k = codec.k(data.size)
    x64 = data.astype(np.float64) + residual.astype(np.float64)
    x = data + residual  # float32, as the core adds
    expected, expected_state = topk_reuse_select(x, k, codec.reuse_steps, state and reference_state(state))
    old = residual.copy()
    idx, val, new_state = _core.topk_contribution(codec.canonical(), data, residual, state)
    problems = []
    if not np.array_equal(x, x64.astype(np.float32)):
        problems.append("x is not the float32 rounding of data + residual")
    if not np.array_equal(idx, expected):
        problems.append(f"sent {idx.size} indices, the reference {expected.size}")
    if reference_state(new_state) != expected_state:
        problems.append(f"state {reference_state(new_state)}, the reference {expected_state}")
    # Exactly what was not sent stays: data + old residual == sent + new residual, bitwise.
    sent = np.zeros_like(data)
    sent[idx] = val
    if not np.array_equal(data + old, sent + residual) or np.any(sent[idx] != x[idx]) or np.any(residual[idx] != 0):
        problems.append("data + old residual != sent + new residual")
    return idx, new_state, problems


def reference_state(state):
    """The core's (magnitude bits, k, uses left) as the reference's (float32 threshold, k, uses left)."""
    bits, k, left = state
    return (np.array([bits], np.uint32).view(np.float32)[0], k, left)


def test_topk_reuse_sends_everything_at_or_above_the_last_exact_threshold():
    """Threshold reuse (reuse_steps=3), 9 calls of one tensor: an exact selection,
    3 calls sending every |x| >= its threshold (their counts vary around k), the
    next exact, ...; each against the float64 reference of the documented rule,
    with the residual keeping exactly what was not sent."""
    codec, n = TopK(0.01, reuse_steps=3), 20_011
    rng = np.random.default_rng(5)
    residual, state, counts, problems = np.zeros(n, np.float32), None, [], []
    for step in range(9):
        # x = data + residual about standard normal every call (as in steady training), so counts stay near k
        data = rng.standard_normal(n).astype(np.float32) - residual
        idx, state, wrong = reuse_step(codec, data, residual, state)
        counts.append(idx.size)
        problems += [f"step {step}: {w}" for w in wrong]
        assert state[2] == 3 - step % 4, state  # calls left after an exact selection (steps 0, 4, 8): 3
    assert not problems, problems
    k = codec.k(n)
    exact, reused = counts[::4], [c for i, c in enumerate(counts) if i % 4]
    assert exact == [k] * 3 and len(set(reused)) > 1 and all(c != k for c in reused), counts


def test_topk_reuse_selects_exactly_when_the_count_leaves_its_bounds():
    """A threshold that would send over 2k values (the data grew 10x) or under
    k/2 (it shrank 10x) is not used: that call selects the exact k and takes
    their threshold. A threshold of 0 (k-th largest |x| is 0) is never reused."""
    codec, n = TopK(0.01, reuse_steps=5), 10_000
    k = codec.k(n)
    rng = np.random.default_rng(6)
    residual, state, problems = np.zeros(n, np.float32), None, []
    for step, scale in enumerate([1.0, 1.0, 10.0, 10.0, 0.1]):
        data = (scale * rng.standard_normal(n)).astype(np.float32) - residual  # x about scale x normal
        above = state and np.count_nonzero(np.abs(data + residual) >= reference_state(state)[0])
        idx, state, wrong = reuse_step(codec, data, residual, state)
        problems += [f"step {step}: {w}" for w in wrong]
        if step in (2, 4):  # 10x: most |x| above the old threshold; 0.1x: none
            assert idx.size == k and state[2] == 5 and (above > 2 * k or above < k / 2), (step, above)
        elif step in (1, 3):
            assert state[2] == 4 and k / 2 <= idx.size <= 2 * k, (step, idx.size)
    assert not problems, problems
    sparse = np.zeros(n, np.float32)
    sparse[:50] = 1.0  # k = 100: the k-th largest magnitude is 0
    _, state, wrong = reuse_step(codec, sparse, np.zeros(n, np.float32), None)
    assert state[0] == 0 and not wrong
    idx, state, wrong = reuse_step(codec, sparse, np.zeros(n, np.float32), state)
    assert idx.size == k and not wrong  # exact again, not every zero


def test_topk_reuse_sends_nan_and_inf_and_clears_them_from_the_residual():
    """NaN and Inf rank above every threshold: a reused threshold sends them, and
    the residual keeps neither."""
    codec, n = TopK(0.01, reuse_steps=2), 4000
    rng = np.random.default_rng(7)
    residual = np.zeros(n, np.float32)
    _, state, _ = reuse_step(codec, rng.standard_normal(n).astype(np.float32), residual, None)
    data = rng.standard_normal(n).astype(np.float32) - residual
    data[[5, 600, 3999]] = [np.nan, np.inf, -np.inf]
    idx, val, state = _core.topk_contribution(codec.canonical(), data, residual, state)
    assert state[2] == 1 and {5, 600, 3999} <= set(idx.tolist())  # reused, and sent
    assert np.isnan(val[list(idx).index(5)]) and np.all(np.isfinite(residual))


def test_topk_reuse_setting_round_trips_and_is_checked():
    reuse = TopK(0.01, algorithm="split", reuse_steps=20)
    assert str(reuse) == "topk(ratio=0.01,algorithm=split,reuse_steps=20)"
    assert str(TopK(0.01, reuse_steps=7)) == "topk(ratio=0.01,reuse_steps=7)"
    assert from_text(str(reuse)) == reuse and from_config(reuse.get_config()) == reuse
    assert TopK(0.01, reuse_steps=0) == TopK(0.01) and str(TopK(0.01, reuse_steps=0)) == "topk(ratio=0.01)"
    assert from_text("topk(ratio=0.01,reuse_steps=0)") == TopK(0.01) and TopK().reuse_steps == 0
    assert _core.codec_config("topk(reuse_steps=1000000,ratio=0.5)")["reuse_steps"] == 10**6
    for bad in (-1, 1.5, True, "3", 10**6 + 1, None):
        with pytest.raises(ValueError, match="reuse_steps"):
            TopK(0.01, reuse_steps=bad)
    for text in ("topk(ratio=0.1,reuse_steps=)", "topk(ratio=0.1,reuse_steps=1,reuse_steps=2)", "topk(reuse_steps=2)"):
        with pytest.raises(ValueError):
            from_text(text)
    with pytest.raises(ValueError, match="not a top-k codec"):
        _core.topk_contribution("int8(block=256)", np.ones(4, np.float32), np.zeros(4, np.float32))
