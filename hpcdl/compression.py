"""Gradient compression codecs for ``hpcdl.allreduce(..., compression=...)``.

Each codec is a small settings object; its canonical text (``str(codec)``,
e.g. ``"int8(block=256)"``) is what travels to the C++ core, what every rank
must agree on (a difference raises MismatchError naming the ranks) and the key
of ``hpcdl.stats()``. Wire formats, error bounds and when to use which:
docs/compression.md.

Error feedback: an allreduce with a ``name`` keeps, per tensor name (and
communicator), a residual of what compression dropped and adds it back before
the next compression of that tensor. A name's residual is freed once
HPCDL_RESIDUAL_TTL_OPS (default 1000) named compressed allreduces ran on its
communicator without it, or by ``free_residual(name)``; ``reset_state()``
forgets all residuals; ``residual_memory()`` is what they take;
``residual(name)`` / ``set_residual(name, values)`` read and set one (a
checkpoint's). Without a name no state is kept.

The C++ core owns the rules: it parses the canonical text (the one reader of
that syntax, ``from_text``), checks every setting, sizes and runs the kernels;
the classes here only spell settings as that text. One codec is not the core's:
PowerSGD factors each gradient matrix with the framework's own matmul and
sends the factors through the dense ring, so its settings are checked here and
it works through a framework adapter (``hpcdl.torch.DistributedOptimizer``),
not ``hpcdl.allreduce``.
"""

import numbers
import re
import zlib

import numpy as np

from hpcdl import _core

__all__ = [
    "Codec",
    "NoCompression",
    "FP16",
    "BF16",
    "Int8",
    "TopK",
    "PowerSGD",
    "from_config",
    "from_text",
    "from_text_list",
    "residual",
    "set_residual",
    "free_residual",
    "residual_memory",
    "reset_state",
]


def _integer(value):
    """An integer setting as the core reads it; anything else as repr, which the core rejects."""
    return str(int(value)) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else repr(value)


def _real(value):
    return repr(float(value)) if isinstance(value, numbers.Real) and not isinstance(value, bool) else repr(value)


def _word(value):
    return value if isinstance(value, str) and value.isalpha() else repr(value)


class Codec:
    """Base class: settings as a dict (get_config/from_config) and a canonical text."""

    name = "?"

    def get_config(self):
        """The codec's settings, enough to rebuild it with from_config()."""
        return {"name": self.name}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        name = config.pop("name", cls.name)
        if name != cls.name:
            raise ValueError(f"config is for codec {name!r}, not {cls.name!r}")
        return cls(**config)

    def canonical(self):
        """The text the core and the other ranks see."""
        return self.name

    def encoded_size(self, count):
        """Bytes that ``count`` float32 values take in one encoded chunk."""
        return _core.codec_encoded_size(self.canonical(), int(count))

    def encode_into(self, values, out, err=None, stream=0):
        """Encode the float32 array ``values`` as one chunk into the uint8 array ``out``
        (encoded_size() bytes) with the engine's kernels, on the calling thread. ``err``
        (float32, same length), if given, receives values - decode(out); ``stream`` keys
        stochastic rounding."""
        _core.codec_encode_into(self.canonical(), values, out, err, stream)

    def decode_into(self, encoded, out):
        """Decode the uint8 array ``encoded`` into the float32 array ``out`` (the original length)."""
        _core.codec_decode_into(self.canonical(), encoded, out)

    def __str__(self):
        return self.canonical() or "none"

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash(self.canonical())


class NoCompression(Codec):
    """Dense float32 on the wire (the same as compression=None)."""

    name = "none"

    def canonical(self):
        return ""


class FP16(Codec):
    """Cast to IEEE half (round to nearest even) on the wire, summed in float32."""

    name = "fp16"


class BF16(Codec):
    """Cast to bfloat16 (round to nearest even) on the wire, summed in float32."""

    name = "bf16"


class Int8(Codec):
    """Blockwise 8-bit: per ``block`` values one float32 scale (absmax/127), then int8.

    rounding: "nearest" (default) or "stochastic" (unbiased; draws come from a
    counter-based RNG keyed by ``seed``, the operation's sequence number, the
    rank and the element index, so a run is reproducible).
    """

    name = "int8"

    def __init__(self, block=_core.DEFAULT_INT8_BLOCK, rounding="nearest", seed=0):
        # Every setting checked by the core (the seed too, which nearest rounding leaves out of the text).
        _core.codec_config(f"int8(block={_integer(block)},rounding={_word(rounding)},seed={_integer(seed)})")
        self.block, self.rounding, self.seed = int(block), rounding, int(seed)

    def get_config(self):
        return {"name": self.name, "block": self.block, "rounding": self.rounding, "seed": self.seed}

    def canonical(self):
        if self.rounding == "nearest":
            return f"int8(block={self.block})"
        return f"int8(block={self.block},rounding=stochastic,seed={self.seed})"


class TopK(Codec):
    """Keep the k = max(1, ceil(ratio * n)) largest magnitudes; (uint32 index, float32 value) pairs.

    algorithm: how the pairs are reduced (docs/compression.md):
    "allgather": every rank sums all ranks' pairs in rank order (bytes per rank
    grow as (p - 1) 8k); "split": a reduce-scatter over p index ranges, an
    exact global top-k of the sums, an allgather of those k pairs (about
    2 (p - 1)/p 8k per rank, flat in p); "auto" (default): the one whose bytes
    received, plus 16 KiB per dependent round (the split has p + 6, the
    allgather one), are fewer for this p and tensor size (``algorithm_for``
    says which). Use it with a name, so error feedback keeps what was dropped.

    reuse_steps: threshold reuse (Ok-Topk), for named tensors: the magnitude
    of the k-th largest value at a rank's exact selection serves that tensor's
    next ``reuse_steps`` allreduces, which send every value at or above it in
    one scan (each rank its own count; an exact selection instead when the
    count leaves [k/2, 2k]). 0 (default): an exact selection every call.
    """

    name = "topk"

    def __init__(self, ratio=0.01, algorithm="auto", reuse_steps=0):
        chosen = "" if algorithm == "auto" else f",algorithm={_word(algorithm)}"
        # Every setting checked by the core (reuse_steps=0 too, which the text leaves out).
        _core.codec_config(f"topk(ratio={_real(ratio)}{chosen},reuse_steps={_integer(reuse_steps)})")
        self.ratio, self.algorithm, self.reuse_steps = float(ratio), algorithm, int(reuse_steps)

    def get_config(self):
        return {"name": self.name, "ratio": self.ratio, "algorithm": self.algorithm, "reuse_steps": self.reuse_steps}

    def canonical(self):
        text = f"topk(ratio={self.ratio!r}"
        if self.algorithm != "auto":
            text += f",algorithm={self.algorithm}"
        return text + (f",reuse_steps={self.reuse_steps})" if self.reuse_steps else ")")

    def k(self, count):
        """How many values a tensor of ``count`` elements keeps (the core's topk_count)."""
        return _core.topk_count(int(count), self.ratio)

    def algorithm_for(self, ranks, count):
        """ "split" or "allgather": what an allreduce of ``count`` float32 values over ``ranks``
        ranks runs with this codec (with "auto", the core's choice)."""
        return _core.topk_algorithm_run(self.canonical(), int(ranks), int(count))


class PowerSGD(Codec):
    """Low-rank gradients (PowerSGD, Vogels et al. 2019) for DistributedOptimizer.

    Each gradient of 2+ dimensions, viewed as an n x m matrix (n = its first
    dimension), for which rank * (n + m) < n * m, is sent as two factors: P
    (n x rank), summed and orthogonalized, and Q (m x rank), warm-started from
    the last step's Q (the first from a generator seeded with ``seed``, the
    same on every rank). What the approximation P Q^T missed is kept per rank
    and added next step (error feedback). The other gradients (biases, norms,
    matrices whose factors would not be smaller) are averaged densely in one
    fused bucket, and the first ``warmup_steps`` steps are dense altogether.
    Semantics, state, costs and wire format: docs/compression.md.
    """

    name = "powersgd"
    MIN_NORM = 1e-30  # a P column whose norm is below this is left as it is (zero stays zero), not blown up

    def __init__(self, rank=1, warmup_steps=10, seed=0):
        for setting, value, least, most in (
            ("rank", rank, 1, None),
            ("warmup_steps", warmup_steps, 0, None),
            ("seed", seed, 0, 2**32 - 1),
        ):  # the seed fills the generator's high word
            if (
                not isinstance(value, numbers.Integral)
                or isinstance(value, bool)
                or value < least
                or (most is not None and value > most)
            ):
                bound = f">= {least}" if most is None else f"in [{least}, {most}]"
                raise ValueError(f"PowerSGD {setting} must be an integer {bound}, got {value!r}")
        self.rank, self.warmup_steps, self.seed = int(rank), int(warmup_steps), int(seed)

    def get_config(self):
        return {"name": self.name, "rank": self.rank, "warmup_steps": self.warmup_steps, "seed": self.seed}

    def canonical(self):
        return f"powersgd(rank={self.rank},warmup_steps={self.warmup_steps},seed={self.seed})"

    @staticmethod
    def matrix_shape(shape):
        """(n, m): a gradient of this shape viewed as a matrix (n its first dimension)."""
        m = 1
        for d in shape[1:]:
            m *= int(d)
        return int(shape[0]), m

    def compresses(self, shape):
        """Whether a gradient of this shape is sent as low-rank factors."""
        if len(shape) < 2:
            return False
        n, m = self.matrix_shape(shape)
        return self.rank * (n + m) < n * m

    def factor_bytes(self, shape):
        """The float32 bytes of P and Q for a gradient of this shape: what it sends after the
        warm-up (what low-rank buckets are sized by)."""
        n, m = self.matrix_shape(shape)
        return 4 * self.rank * (n + m)

    def initial_q(self, name, m):
        """Q before the first compressed step, m x rank float32: standard normals of numpy's
        PCG64 seeded (seed << 32) | crc32(name), the same on every rank and in every framework."""
        rng = np.random.Generator(np.random.PCG64((self.seed << 32) | zlib.crc32(name.encode())))
        return rng.standard_normal((m, self.rank), dtype=np.float32)

    def encoded_size(self, count):
        raise TypeError(
            "PowerSGD's size depends on the matrix shape: rank * (n + m) float32 values per "
            "n x m gradient (docs/compression.md)"
        )


_CODECS = {c.name: c for c in (NoCompression, FP16, BF16, Int8, TopK, PowerSGD)}
_FRAMEWORK_CODECS = (PowerSGD,)  # run by the framework adapters, not by the core


def from_config(config):
    """Rebuild a codec from its get_config() dict."""
    try:
        cls = _CODECS[config["name"]]
    except (KeyError, TypeError):
        raise ValueError(f"not a codec config: {config!r} (name one of {sorted(_CODECS)})") from None
    return cls.from_config(config)


def from_text(text):
    """The codec that a canonical text names (``str(codec)``: "none", "fp16", "bf16",
    "int8(block=64)", "int8(block=256,rounding=stochastic,seed=7)", "topk(ratio=0.01)",
    "topk(ratio=0.01,algorithm=split)", "topk(ratio=0.01,reuse_steps=20)"), read by the core's parser, or
    "powersgd(rank=1,warmup_steps=10,seed=0)", whose integer settings PowerSGD
    checks; a bare name ("int8", "topk", "powersgd") is that codec with its
    default settings."""
    text = text.strip()
    if text in _CODECS:
        return _CODECS[text]()
    framework = re.fullmatch(r"(\w+)\(((?:\w+=\d+,?)*)\)", text)
    if framework and framework.group(1) in {c.name for c in _FRAMEWORK_CODECS}:
        settings = dict(item.split("=") for item in framework.group(2).split(",") if item)
        return from_config(dict({k: int(v) for k, v in settings.items()}, name=framework.group(1)))
    return from_config(_core.codec_config(text))


def from_text_list(text):
    """The codecs of comma-separated texts, e.g. "none,fp16,int8(block=64,rounding=stochastic,seed=1)"."""
    return [from_text(item) for item in re.split(r",(?![^()]*\))", text) if item.strip()]


def canonical(compression):
    """The core's text for a ``compression=`` argument (None: dense)."""
    if compression is None:
        return ""
    if not isinstance(compression, Codec):
        raise TypeError(f"compression must be an hpcdl.compression codec or None, got {type(compression).__name__}")
    if isinstance(compression, _FRAMEWORK_CODECS):
        raise TypeError(
            f"{compression!r} factors gradient matrices of a model: pass it to "
            "hpcdl.torch.DistributedOptimizer(..., compression=...), not to an allreduce of one buffer"
        )
    return compression.canonical()


def residual(name, comm=None):
    """A copy (float32) of the error-feedback residual kept for tensor ``name``, or None."""
    from mpi4py import MPI

    return _core.residual(MPI.COMM_WORLD if comm is None else comm, name)


def set_residual(name, values, comm=None):
    """Make ``values`` (float32, one per element of tensor ``name``) the error-feedback
    residual of ``name`` on ``comm`` (default COMM_WORLD), on this rank only, e.g. from a
    checkpoint of ``residual()``: its next compressed allreduce adds it. Set before the
    communicator's first operation, it is held until then. Between steps: an allreduce of
    ``name`` in flight keeps the residual it started with."""
    from mpi4py import MPI

    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    values = np.asarray(values)
    if values.ndim != 1 or values.dtype != np.float32:
        raise ValueError(f"a residual is a 1-D float32 array, got {values.ndim}-D {values.dtype}")
    _core.set_residual(MPI.COMM_WORLD if comm is None else comm, name, values)


def free_residual(name, comm=None):
    """Free the error-feedback residual of tensor ``name`` on ``comm`` (default
    COMM_WORLD) now, on this rank; True when there was one. Its next compressed
    allreduce starts from a zero residual."""
    from mpi4py import MPI

    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    return _core.free_residual(MPI.COMM_WORLD if comm is None else comm, name)


def residual_memory():
    """Bytes the error-feedback residuals of this process take (all names, all communicators)."""
    return _core.residual_bytes()


def reset_state():
    """Forget every error-feedback residual (e.g. between training runs)."""
    _core.reset_compression_state()
